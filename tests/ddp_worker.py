"""Helper for test_train_ddp.py: a few MTP training steps on a fixed global batch, single
process or DDP (Lightning re-runs this file for rank 1), then save the trained depths."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers.models import randomize_, tiny_config
from inkfw.models.inkling.model import InklingLM
from inkfw.train.module import InklingTrainModule
from inkfw.train.schedules import warmup_cosine
from inkfw.train.tasks import MtpTask


def main(devices: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=2))
    ids = torch.randint(0, 90, (8, 16), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(ids, torch.zeros_like(ids))
    global_batch = 4

    class Rows(L.LightningDataModule):  # rank r reads rows r, r + devices, ...: step s covers rows 4s..4s+3
        def train_dataloader(self):
            sampler = DistributedSampler(data, num_replicas=devices, rank=self.trainer.global_rank, shuffle=False)
            return DataLoader(data, batch_size=global_batch // devices, sampler=sampler)

    module = InklingTrainModule(
        model,
        MtpTask(),
        optimizer=partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0),
        scheduler=partial(warmup_cosine, warmup_steps=1, max_steps=2),
    )
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        use_distributed_sampler=False,
    )
    trainer.fit(module, datamodule=Rows())
    if trainer.is_global_zero:
        torch.save({k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}, out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
