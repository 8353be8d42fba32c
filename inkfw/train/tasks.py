"""What differs between the training tasks of ``scripts/train.py`` (``inkfw/conf/task/``).

A task builds the model, chooses what trains, and computes the loss of a batch; the
LightningModule (:mod:`inkfw.train.module`) delegates all three to it.

* :class:`MtpTask` (``task=mtp``): MTP depths on a frozen checkpoint. The backbone, the
  embedding and the unembedding are frozen (and run without autograd); depths
  ``[train_from, num_depths)`` train, earlier depths stay frozen. Depths beyond those the
  checkpoint ships start from the deepest shipped depth of the same attention kind. With
  ``data=hidden`` (:mod:`inkfw.train.hidden`) batches carry the backbone's stored final hidden
  states, and the backbone's layers do not run (the embedding and the unembedding still do).
* :class:`PretrainTask` (``task=pretrain``): a random-init preset trains from scratch; the
  loss is next-token CE plus ``mtp_weight`` times the depth loss (which does not flow into
  the backbone).

Both share the depth loss (:func:`inkfw.train.losses.mtp_losses`): ``objective`` ``ce`` or
``kl``, mixed over depths by ``beta``^d normalised or explicit ``weights``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F

from inkfw.errors import ConfigError
from inkfw.models.inkling.checkpoint import load_model
from inkfw.models.inkling.model import EmbedSource, InklingLM
from inkfw.models.inkling.mtp import MtpDepth
from inkfw.presets import build_model, model_config, resolve_path
from inkfw.train.losses import depth_weights, mtp_losses, target_mask

OBJECTIVES = ("ce", "kl")

# (input_ids [B, T], doc_ids [B, T]), and from data=hidden also the stored final hidden states [B, T, H]
Batch = tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Logs = dict[str, float | torch.Tensor]


@dataclass
class TrainTask(ABC):
    """A task's options (the ``inkfw/conf/task`` node) and what it does with a model."""

    name: str  # names the run: output_dir runs/<name>, the logger's run name
    objective: str = "ce"  # depth loss: ce (true tokens) | kl (self-distillation to the backbone)
    beta: float = 0.7  # depth weights beta^d, normalised
    weights: Sequence[float] | None = None  # explicit per-depth weights instead
    _depth_w: torch.Tensor | None = field(default=None, init=False, repr=False)  # [D], set by prepare
    # whether batches may carry the backbone's stored hidden states instead (data=hidden)
    reads_stored_hidden: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"loss.objective must be 'ce' or 'kl', got {self.objective!r}.")
        if self.weights is not None:
            self.weights = [float(w) for w in self.weights]

    @abstractmethod
    def build_model(
        self, model_node: Any, depths: int | None, embed_source: EmbedSource
    ) -> tuple[InklingLM, Path | None]:
        """(the model to train with ``depths`` MTP depths, in train mode; the checkpoint's
        tokenizer.json or None). ``model_node`` is a ``inkfw/conf/model`` node."""

    @abstractmethod
    def prepare(self, model: InklingLM) -> None:
        """Check the options against ``model`` and freeze what does not train."""

    @abstractmethod
    def loss(self, model: InklingLM, batch: Batch) -> tuple[torch.Tensor, Logs]:
        """(loss, named metrics) of one batch."""

    def _set_depth_weights(self, model: InklingLM) -> None:
        D = model.num_mtp_depths
        self._depth_w = depth_weights(D, self.beta, self.weights) if D else torch.zeros(0)

    def depth_loss(
        self,
        model: InklingLM,
        batch: Batch,
        hidden: torch.Tensor,
        train_from: int,
        backbone_logits: torch.Tensor | None,
        logs: Logs,
    ) -> torch.Tensor:
        """The weighted loss of depths ``[train_from, D)``; per-depth metrics go into ``logs``."""
        if self._depth_w is None:
            raise RuntimeError("prepare(model) must run before the loss.")
        ids, doc = batch[0], batch[1]
        if self._depth_w.device != hidden.device:
            self._depth_w = self._depth_w.to(hidden.device)
        stats = mtp_losses(
            model,
            ids,
            doc,
            train_from=train_from,
            weights=self._depth_w,
            objective=self.objective,
            hidden=hidden.detach(),
            backbone_logits=backbone_logits,
        )
        for d in range(model.num_mtp_depths):
            logs[f"depth{d}/ce"] = stats.ce[d]
            logs[f"depth{d}/kl"] = stats.kl[d]
            logs[f"depth{d}/agreement"] = stats.agreement[d]
        logs["simulated_acceptance_length"] = stats.simulated_acceptance_length
        return stats.loss


def grow_depths(model: InklingLM, depths: int) -> InklingLM:
    """``model`` with ``depths`` MTP depths: existing ones kept, new ones copied from the
    deepest existing depth of the same attention kind (random init if there is none)."""
    have = model.num_mtp_depths
    if depths <= have:
        return model
    grown = InklingLM(
        model.cfg.with_mtp_depths(depths), mtp_depths=depths, embed_source=cast(EmbedSource, model.embed_source)
    )
    grown.init_weights()
    grown.load_state_dict(model.state_dict(), strict=False)
    old, new = mtp_depth_modules(model), mtp_depth_modules(grown)
    for d in range(have, depths):
        kind = new[d].block.attn.window
        donors = [s for s in range(have) if old[s].block.attn.window == kind]
        if donors:
            new[d].load_state_dict(old[donors[-1]].state_dict())
    return grown.to(next(model.parameters()).device)


def mtp_depth_modules(model: InklingLM) -> list[MtpDepth]:
    """The model's MTP depths, in order (none if it has none)."""
    return [cast(MtpDepth, depth) for depth in model.mtp.depths] if model.mtp is not None else []


def freeze_for_mtp(model: InklingLM, train_from: int) -> None:
    """Leave only depths >= ``train_from`` trainable (and the shared chain_norm when every
    depth trains)."""
    for p in model.parameters():
        p.requires_grad_(False)
    for depth in mtp_depth_modules(model)[train_from:]:
        for p in depth.parameters():
            p.requires_grad_(True)
    if train_from == 0 and model.mtp is not None and model.mtp.chain_norm is not None:
        model.mtp.chain_norm.weight.requires_grad_(True)


@dataclass
class MtpTask(TrainTask):
    """``task=mtp``: depths ``[train_from, D)`` on a frozen checkpoint (see the module docstring)."""

    name: str = "mtp"
    reads_stored_hidden: ClassVar[bool] = True
    # first depth to train; None: the first new depth when :meth:`build_model` adds depths,
    # else 0 (every depth). build_model replaces None with the depth it chose.
    train_from: int | None = None

    def build_model(
        self, model_node: Any, depths: int | None, embed_source: EmbedSource
    ) -> tuple[InklingLM, Path | None]:
        path = model_node.get("path")
        if not path:
            raise ConfigError("task=mtp trains depths on a checkpoint: set model=inkling model.path=DIR.")
        shipped = model_config(model_node).mtp.num_nextn_predict_layers
        depths = shipped if depths is None else int(depths)
        if depths < 1:
            raise ConfigError(f"mtp.depths must be >= 1, got {depths}.")
        train_from = (shipped if depths > shipped else 0) if self.train_from is None else int(self.train_from)
        if not 0 <= train_from <= shipped or train_from >= depths:
            raise ConfigError(
                f"mtp.train_from={train_from} must lie in [0, {min(shipped, depths - 1)}]: the "
                f"checkpoint ships {shipped} depth(s) and new depths start right after them."
            )
        self.train_from = train_from
        model, ckpt = load_model(resolve_path(path), mtp_depths=min(depths, shipped), embed_source=embed_source)
        return grow_depths(model.train(), depths), ckpt.tokenizer_path

    def prepare(self, model: InklingLM) -> None:
        D = model.num_mtp_depths
        train_from = 0 if self.train_from is None else self.train_from
        if not 0 <= train_from < D:
            raise ConfigError(f"mtp.train_from must lie in [0, {D}) for {D} depths, got {train_from}.")
        self.train_from = train_from
        self._set_depth_weights(model)
        freeze_for_mtp(model, train_from)

    def loss(self, model: InklingLM, batch: Batch) -> tuple[torch.Tensor, Logs]:
        if len(batch) > 2:  # data=hidden: the frozen backbone's output, stored by scripts/dump_hidden.py
            hidden = batch[2].to(model.unembed.weight.dtype)  # [B, T, H]
        else:
            with torch.no_grad():
                hidden = model(batch[0])  # [B, T, H], frozen backbone
        logs: Logs = {}
        loss = self.depth_loss(model, batch, hidden, int(self.train_from or 0), None, logs)
        return loss, logs


@dataclass
class PretrainTask(TrainTask):
    """``task=pretrain``: everything trains from a random-init preset (``model.sizes``)."""

    name: str = "pretrain"
    mtp_weight: float = 1.0  # weight of the depth loss next to the LM loss

    def build_model(
        self, model_node: Any, depths: int | None, embed_source: EmbedSource
    ) -> tuple[InklingLM, Path | None]:
        model = build_model(model_node, mtp_depths=depths, embed_source=embed_source)
        return model.train(), None

    def prepare(self, model: InklingLM) -> None:
        self._set_depth_weights(model)

    def loss(self, model: InklingLM, batch: Batch) -> tuple[torch.Tensor, Logs]:
        if len(batch) > 2:
            raise ConfigError(
                "task=pretrain trains the backbone, so it cannot train from stored hidden states (data=hidden)."
            )
        ids, doc = batch[0], batch[1]  # [B, T], [B, T]
        hidden = model(ids)  # [B, T, H]
        mask = target_mask(doc, 1)[:, :-1]  # [B, T-1]
        logits = model.logits(hidden).float()  # [B, T, V], also the depths' teacher below
        lm = F.cross_entropy(logits[:, :-1][mask], ids[:, 1:][mask])
        logs: Logs = {"lm_ce": lm.detach()}
        loss = hidden.new_zeros((), dtype=torch.float32) + lm
        if model.num_mtp_depths:
            loss = loss + self.mtp_weight * self.depth_loss(model, batch, hidden, 0, logits, logs)
        return loss, logs
