"""The LightningModule behind ``scripts/train.py``: ``task=mtp`` and ``task=pretrain``.

``mtp``: the backbone, the embedding and the unembedding are frozen (and run without
autograd); depths ``[train_from, num_depths)`` train, earlier depths stay frozen. ``pretrain``:
everything trains; the loss is next-token CE plus ``mtp_weight`` times the depth loss.
Both log per-depth CE / KL, top-1 agreement with the backbone's greedy token and the simulated
acceptance length, so a run shows what serving will see.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn.functional as F

from inkfw.errors import ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.train.losses import depth_weights, mtp_losses, target_mask


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    max_steps: int = 1000
    schedule: str = "cosine"  # cosine | constant
    min_lr_ratio: float = 0.1

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        if self.schedule != "cosine":
            raise ConfigError(f"optim.schedule must be 'cosine' or 'constant', got {self.schedule!r}.")
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def freeze_for_mtp(model: InklingLM, train_from: int) -> None:
    """Leave only depths >= ``train_from`` trainable (and the shared chain_norm when every
    depth trains)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for depth in list(model.mtp.depths)[train_from:]:
        for p in depth.parameters():
            p.requires_grad_(True)
    if train_from == 0 and model.mtp.chain_norm is not None:
        model.mtp.chain_norm.weight.requires_grad_(True)


class InklingTrainModule(L.LightningModule):
    def __init__(self, model: InklingLM, task: str = "mtp", train_from: int = 0, beta: float = 0.7,
                 weights: list[float] | None = None, objective: str = "ce", mtp_weight: float = 1.0,
                 optim: OptimConfig | None = None, eval_prompts: list[list[int]] | None = None,
                 eval_max_new_tokens: int = 32):
        super().__init__()
        self.eval_prompts, self.eval_max_new_tokens = eval_prompts or [], eval_max_new_tokens
        if task not in ("mtp", "pretrain"):
            raise ConfigError(f"task must be 'mtp' or 'pretrain', got {task!r}.")
        D = model.num_mtp_depths
        if task == "mtp" and not 0 <= train_from < D:
            raise ConfigError(f"mtp.train_from must lie in [0, {D}) for {D} depths, got {train_from}.")
        self.model, self.task, self.train_from = model, task, train_from if task == "mtp" else 0
        self.objective, self.mtp_weight = objective, mtp_weight
        self.optim = optim or OptimConfig()
        self.register_buffer("depth_w", depth_weights(D, beta, weights) if D else torch.zeros(0), persistent=False)
        if task == "mtp":
            freeze_for_mtp(model, train_from)
        self._t0: float | None = None

    def compute(self, batch) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """(loss, named metrics) of one batch ``(input_ids [B, T], doc_ids [B, T])``."""
        ids, doc = batch  # [B, T], [B, T]
        model = self.model
        if self.task == "mtp":
            with torch.no_grad():
                hidden = model(ids)  # frozen backbone
        else:
            hidden = model(ids)
        logs: dict[str, float | torch.Tensor] = {}
        loss = hidden.new_zeros((), dtype=torch.float32)
        logits = None
        if self.task == "pretrain":
            mask = target_mask(doc, 1)[:, :-1]  # [B, T-1]
            logits = model.logits(hidden).float()  # [B, T, V], also the depths' teacher below
            lm = F.cross_entropy(logits[:, :-1][mask], ids[:, 1:][mask])
            loss = loss + lm
            logs["lm_ce"] = lm.detach()
        if model.num_mtp_depths:
            stats = mtp_losses(model, ids, doc, train_from=self.train_from, weights=self.depth_w,
                               objective=self.objective, hidden=hidden.detach(), backbone_logits=logits)
            loss = loss + (self.mtp_weight if self.task == "pretrain" else 1.0) * stats.loss
            for d in range(model.num_mtp_depths):
                logs[f"depth{d}/ce"] = stats.ce[d]
                logs[f"depth{d}/kl"] = stats.kl[d]
                logs[f"depth{d}/agreement"] = stats.agreement[d]
            logs["simulated_acceptance_length"] = stats.simulated_acceptance_length
        return loss, logs

    def _logged(self, batch, stage: str) -> torch.Tensor:
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
        """The real engine's mean acceptance length (greedy, k = D) on the held-out prompts."""
        from inkfw.cache.paged import PagedKVManager
        from inkfw.speculative.drafters import MtpDrafter
        from inkfw.speculative.engine import Engine
        from inkfw.speculative.verifier import TargetVerifier

        was_training = self.model.training
        self.model.eval()
        try:
            drafter = MtpDrafter(self.model)
            kv = PagedKVManager(self.model, num_draft_depths=drafter.num_depths, lookahead=drafter.lookahead,
                                num_draft_tokens=drafter.num_tokens, max_num_seqs=len(self.eval_prompts),
                                max_model_len=max(map(len, self.eval_prompts)) + self.eval_max_new_tokens + 1)
            engine = Engine(self.model, drafter, TargetVerifier(), kv)
            requests = [engine.add_request(p, max_new_tokens=self.eval_max_new_tokens) for p in self.eval_prompts]
            engine.generate(requests)
            return engine.metrics.mean_acceptance_length
        finally:
            self.model.train(was_training)

    def on_validation_epoch_end(self) -> None:
        if self.eval_prompts and self.model.num_mtp_depths and not self.trainer.sanity_checking:
            tau = self.engine_acceptance_length() if self.trainer.is_global_zero else 0.0
            self.log("val/engine_acceptance_length", tau, rank_zero_only=True)

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("nothing to train: every parameter is frozen.")
        o = self.optim
        opt = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, o.lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
