"""The LightningModule: frozen parameters stay bit-identical; the loss decreases on a fixed batch."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from inkfw.errors import ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.train.module import InklingTrainModule, OptimConfig
from helpers.models import randomize_, tiny_config


def _fit(module, batch, steps):
    ids, doc = batch
    loader = DataLoader(TensorDataset(ids, doc), batch_size=ids.shape[0])
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, loader)


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 90, (4, 24), generator=g)
    doc = torch.zeros_like(ids)
    doc[:, 12:] = 1
    return ids, doc


def _losses(module, batch):
    with torch.no_grad():
        return float(module.compute(batch)[0])


def test_mtp_task_freezes_and_learns(tmp_path):
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    module = InklingTrainModule(model, task="mtp", train_from=1, optim=OptimConfig(lr=3e-3, warmup_steps=1, max_steps=30))
    batch = _batch()
    start = _losses(module, batch)
    _fit(module, batch, 30)
    assert _losses(module, batch) < 0.8 * start
    after = model.state_dict()
    frozen = [k for k in before if not k.startswith(("mtp.depths.1.", "mtp.depths.2."))]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert not torch.equal(before["mtp.depths.2.input_proj.weight"], after["mtp.depths.2.input_proj.weight"])


def test_pretrain_task_trains_backbone():
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=1))
    w0 = model.backbone.embed.weight.clone()
    module = InklingTrainModule(model, task="pretrain", optim=OptimConfig(lr=3e-3, warmup_steps=1, max_steps=10))
    batch = _batch(1)
    start = _losses(module, batch)
    _fit(module, batch, 10)
    assert _losses(module, batch) < start
    assert not torch.equal(w0, model.backbone.embed.weight)


def test_bad_task_values():
    model = InklingLM(tiny_config(), mtp_depths=2)
    with pytest.raises(ConfigError):
        InklingTrainModule(model, task="mtp", train_from=2)
    with pytest.raises(ConfigError):
        InklingTrainModule(model, task="finetune")
