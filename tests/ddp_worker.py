"""Helper for test_train_ddp.py and test_train_fsdp.py: two MTP training steps on a fixed global
batch, then one validation with the engine's acceptance, with the trainer built from a
``inkfw/conf/trainer`` option: ``single`` (trainer=cpu), ``ddp`` (trainer=ddp, 2 processes) or
``fsdp`` (trainer=fsdp on the CPU, 2 processes, with activation checkpointing). Lightning
re-runs this file for rank 1. Rank 0 saves the trained depths and the logged acceptance to
``out``; with FSDP every rank also writes what it held during training to ``out.rank<r>.json``.

    python tests/ddp_worker.py single|ddp|fsdp OUT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from functools import cache, partial
from pathlib import Path

import lightning as L
import torch
from hydra import compose, initialize_config_dir
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.models import randomize_, tiny_config
from inkfw.models.inkling.model import InklingLM
from inkfw.nodes import build_node
from inkfw.paths import config_dir
from inkfw.train.module import InklingTrainModule
from inkfw.train.schedules import warmup_cosine
from inkfw.train.tasks import MtpTask

MODES = {  # mode -> (processes, trainer options)
    "single": (1, ["trainer=cpu"]),
    "ddp": (2, ["trainer=ddp"]),
    "fsdp": (2, ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]),
}
MTP_DEPTHS = 2
EVAL_PROMPTS = [[5, 17, 3, 44, 9, 12], [60, 2, 2, 31, 7, 80]]


def trainer_config(mode: str, output_dir: str):
    overrides = [
        *MODES[mode][1],
        f"output_dir={output_dir}",
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        "trainer.log_every_n_steps=1",
    ]
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=overrides).trainer


def layout(model: InklingLM) -> dict:
    """What this rank holds: which modules are FSDP units, and local vs whole sizes."""
    assert model.mtp is not None
    depths = list(model.mtp.depths)
    return {
        "depth_is_unit": [isinstance(d, FSDP) for d in depths],
        "depth_local_numel": [sum(p.numel() for p in d.parameters()) for d in depths],
        "backbone_units": sum(isinstance(m, FSDP) for m in model.backbone.modules()),
        "backbone_shapes": {n: list(p.shape) for n, p in model.backbone.named_parameters()},
        "unembed_shape": list(model.unembed.weight.shape),
    }


class RecordLayout(L.Callback):
    def __init__(self, out: str):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            Path(f"{self.out}.rank{trainer.global_rank}.json").write_text(json.dumps(layout(pl_module.model)))


def main(mode: str, out: str) -> None:
    devices = MODES[mode][0]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=MTP_DEPTHS))
    ids = torch.randint(0, 90, (8, 16), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(ids, torch.zeros_like(ids))
    global_batch = 4

    class Rows(L.LightningDataModule):  # rank r reads rows r, r + devices, ...: step s covers rows 4s..4s+3
        def _loader(self):
            sampler = DistributedSampler(data, num_replicas=devices, rank=self.trainer.global_rank, shuffle=False)
            return DataLoader(data, batch_size=global_batch // devices, sampler=sampler)

        def train_dataloader(self):
            return self._loader()

        def val_dataloader(self):
            return self._loader()

    module = InklingTrainModule(
        model,
        MtpTask(),
        optimizer=partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0),
        scheduler=partial(warmup_cosine, warmup_steps=1, max_steps=2),
        eval_prompts=EVAL_PROMPTS,
        eval_max_new_tokens=8,
        activation_checkpointing=mode == "fsdp",
    )
    trainer: L.Trainer = build_node(
        "trainer",
        trainer_config(mode, str(Path(out).parent / f"{mode}-run")),
        logger=False,
        callbacks=[RecordLayout(out)] if mode == "fsdp" else [],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=Rows())
    if trainer.is_global_zero:
        depths = {k: v.clone() for k, v in model.state_dict().items() if k.startswith("mtp.")}
        tau = trainer.callback_metrics["val/engine_acceptance_length"]
        plain = not any(isinstance(m, FSDP) for m in model.modules())
        torch.save({"depths": depths, "engine_acceptance_length": float(tau), "plain_after_fit": plain}, out)


@cache
def trained(mode: str) -> dict:
    """Run this file for ``mode`` in fresh processes (once per test session): rank 0's results,
    plus ``ranks``, the per-rank layouts of an FSDP run."""
    with tempfile.TemporaryDirectory(prefix=f"inkfw-{mode}-") as tmp:
        out = Path(tmp) / "result.pt"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, mode, str(out)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        result = torch.load(out)
        ranks = sorted(out.parent.glob(f"{out.name}.rank*.json"))
        result["ranks"] = [json.loads(p.read_text()) for p in ranks]
    return result


def initial_depths() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=MTP_DEPTHS))
    return {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
