"""The LightningModule and its task objects: frozen parameters stay bit-identical; the loss
decreases on a fixed batch; the schedules; checkpoints carry the training config."""

from __future__ import annotations

import math
from functools import partial

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from helpers.models import randomize_, tiny_config
from inkfw.errors import CheckpointError, ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.train.module import InklingTrainModule
from inkfw.train.run import read_training_checkpoint
from inkfw.train.schedules import warmup_constant, warmup_cosine
from inkfw.train.tasks import MtpTask, PretrainTask


def _optim(lr: float, max_steps: int) -> dict:
    """AdamW and the warm-up + cosine schedule as inkfw/conf/optim/adamw.yaml and
    inkfw/conf/scheduler/cosine.yaml build them."""
    return {
        "optimizer": partial(torch.optim.AdamW, lr=lr, betas=(0.9, 0.95), weight_decay=0.0),
        "scheduler": partial(warmup_cosine, warmup_steps=1, max_steps=max_steps, min_lr_ratio=0.1),
    }


def _fit(module, batch, steps):
    ids, doc = batch
    loader = DataLoader(TensorDataset(ids, doc), batch_size=ids.shape[0])
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
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
    module = InklingTrainModule(model, MtpTask(train_from=1), **_optim(3e-3, 30))
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
    module = InklingTrainModule(model, PretrainTask(), **_optim(3e-3, 10))
    batch = _batch(1)
    start = _losses(module, batch)
    _fit(module, batch, 10)
    assert _losses(module, batch) < start
    assert not torch.equal(w0, model.backbone.embed.weight)


def test_bad_task_values():
    model = InklingLM(tiny_config(), mtp_depths=2)
    with pytest.raises(ConfigError, match="train_from"):
        InklingTrainModule(model, MtpTask(train_from=2))
    with pytest.raises(ConfigError, match="objective"):
        MtpTask(objective="mse")
    with pytest.raises(ConfigError, match="loss.weights"):
        InklingTrainModule(model, PretrainTask(weights=[1.0]))  # 2 depths, 1 weight


def _lrs(scheduler_factory, steps: int, lr: float = 1.0) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = scheduler_factory(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedules_warm_up_then_decay_or_hold():
    cosine = _lrs(partial(warmup_cosine, warmup_steps=4, max_steps=12, min_lr_ratio=0.1), 14)
    assert cosine[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert cosine[4] == pytest.approx(1.0)  # decay starts after the warm-up
    assert cosine[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cosine[12:] == pytest.approx([0.1, 0.1])  # min_lr_ratio from max_steps on
    assert all(a >= b for a, b in zip(cosine[3:], cosine[4:]))
    constant = _lrs(partial(warmup_constant, warmup_steps=2), 6)
    assert constant == pytest.approx([0.5, 1.0, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ConfigError, match="warmup_steps"):
        _lrs(partial(warmup_constant, warmup_steps=-1), 1)


def test_resumed_schedule_follows_its_own_config():
    """A checkpointed schedule restores its step, not the old run's max_steps (a longer resumed
    run decays over its own length)."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    short = warmup_cosine(opt, warmup_steps=0, max_steps=4)
    for _ in range(3):
        opt.step()
        short.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    long = warmup_cosine(opt2, warmup_steps=0, max_steps=8)
    long.load_state_dict(short.state_dict())
    long.step()
    expected = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 8))
    assert long.get_last_lr()[0] == pytest.approx(expected)


def test_checkpoints_carry_the_training_config(tmp_path):
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=2))
    train_config = {"task": {"_target_": "inkfw.train.tasks.MtpTask", "train_from": 1}, "output_dir": str(tmp_path)}
    module = InklingTrainModule(model, MtpTask(train_from=1), **_optim(1e-3, 2), train_config=train_config)
    ckpt = tmp_path / "a.ckpt"
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    ids, doc = _batch()
    trainer.fit(module, DataLoader(TensorDataset(ids, doc), batch_size=4))
    trainer.save_checkpoint(ckpt)
    saved, state = read_training_checkpoint(ckpt)
    assert saved.task.train_from == 1 and saved.output_dir == str(tmp_path)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    # a checkpoint without a training config is refused in one sentence
    module = InklingTrainModule(model, MtpTask(train_from=1), **_optim(1e-3, 2))
    trainer = L.Trainer(
        max_steps=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(TensorDataset(ids, doc), batch_size=4))
    trainer.save_checkpoint(tmp_path / "b.ckpt")
    with pytest.raises(CheckpointError, match="holds no training config"):
        read_training_checkpoint(tmp_path / "b.ckpt")
