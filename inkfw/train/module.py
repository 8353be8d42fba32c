"""The LightningModule behind ``scripts/train.py``.

What differs between tasks (which parameters train, the loss) is the task object's
(:mod:`inkfw.train.tasks`); the optimizer and the learning-rate schedule are callables built
from ``inkfw/conf/optim`` and ``inkfw/conf/scheduler``. Every task logs per-depth CE / KL, top-1
agreement with the backbone's greedy token and the simulated acceptance length, and after
each validation the real engine's mean acceptance length, so a run shows what serving will see.

With ``train_config`` (the resolved training config) the module saves it as its
hyperparameters, so every Lightning checkpoint describes the run that wrote it
(``scripts/export.py ckpt_path=...`` needs nothing else).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from inkfw.errors import ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.nodes import call_node
from inkfw.train.strategies import checkpoint_trainable_depths, gathered_parameters
from inkfw.train.tasks import Batch, Logs, TrainTask

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], Optimizer]  # inkfw/conf/optim: _partial_ node
SchedulerFactory = Callable[[Optimizer], LRScheduler]  # inkfw/conf/scheduler: _partial_ node


class InklingTrainModule(L.LightningModule):
    def __init__(
        self,
        model: InklingLM,
        task: TrainTask,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        eval_prompts: list[list[int]] | None = None,
        eval_max_new_tokens: int = 32,
        train_config: dict[str, Any] | None = None,
        activation_checkpointing: bool = False,
    ):
        """``optimizer`` None: ``torch.optim.AdamW`` with torch's defaults; ``scheduler`` None: a
        constant learning rate. ``eval_prompts``: token ids of held-out prompts for the engine's
        acceptance after each validation (none: off). ``activation_checkpointing``: recompute the
        trainable depths' activations in the backward pass (less memory, one more depth forward)."""
        super().__init__()
        if train_config is not None:
            self.save_hyperparameters(train_config)  # into every checkpoint (and the logger)
        self.model, self.task = model, task
        self.optimizer_factory = optimizer or torch.optim.AdamW
        self.scheduler_factory = scheduler
        self.eval_prompts, self.eval_max_new_tokens = eval_prompts or [], eval_max_new_tokens
        task.prepare(model)
        if activation_checkpointing:
            checkpoint_trainable_depths(model)
        self._t0: float | None = None

    def compute(self, batch: Batch) -> tuple[torch.Tensor, Logs]:
        """(loss, named metrics) of one batch ``(input_ids [B, T], doc_ids [B, T])``."""
        return self.task.loss(self.model, batch)

    def _logged(self, batch: Batch, stage: str) -> torch.Tensor:
        loss, logs = self.compute(batch)
        B = batch[0].shape[0]
        self.log_dict({f"{stage}/{k}": v for k, v in logs.items()}, sync_dist=stage == "val", batch_size=B)
        self.log(f"{stage}/loss", loss.detach(), prog_bar=True, sync_dist=stage == "val", batch_size=B)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._logged(batch, "train")
        now = time.perf_counter()
        if self._t0 is not None:
            self.log("train/tokens_per_s", batch[0].numel() / max(now - self._t0, 1e-9), batch_size=batch[0].shape[0])
        self._t0 = now
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"], batch_size=batch[0].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        return self._logged(batch, "val")

    @torch.no_grad()
    def engine_acceptance_length(self) -> float:
        """The real engine's mean acceptance length (greedy, k = D) on the held-out prompts,
        with the engine built by the one factory around the model being trained."""
        from inkfw.speculative.factory import build_engine, serving_config

        max_model_len = max(map(len, self.eval_prompts)) + self.eval_max_new_tokens + 1
        cfg = serving_config(
            [
                "model.path=null",  # the model is given; prompts are token ids: no checkpoint, no tokenizer
                "drafter=mtp",
                f"mtp.depths={self.model.num_mtp_depths}",
                "spec.num_tokens=null",  # k = D
                "sampler.temperature=0",  # greedy
                f"engine.max_num_seqs={len(self.eval_prompts)}",
                f"engine.max_model_len={max_model_len}",
            ]
        )
        was_training = self.model.training
        self.model.eval()
        try:
            engine, _ = build_engine(cfg, model=self.model, tokenizer=None)
            requests = [engine.add_request(p, max_new_tokens=self.eval_max_new_tokens) for p in self.eval_prompts]
            engine.generate(requests)
            return engine.metrics.mean_acceptance_length
        finally:
            self.model.train(was_training)

    def on_validation_epoch_end(self) -> None:
        if self.eval_prompts and self.model.num_mtp_depths and not self.trainer.sanity_checking:
            with gathered_parameters(self.trainer.strategy.model):  # sharded depths: whole on every rank (FSDP)
                tau = self.engine_acceptance_length() if self.trainer.is_global_zero else 0.0
            self.log("val/engine_acceptance_length", tau, rank_zero_only=True)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("nothing to train: every parameter is frozen.")
        optimizer = call_node("optim", self.optimizer_factory, params)
        if self.scheduler_factory is None:
            return optimizer
        return {
            "optimizer": optimizer,
            "lr_scheduler": {
                "scheduler": call_node("scheduler", self.scheduler_factory, optimizer),
                "interval": "step",
            },
        }
