"""Per-depth MTP losses over whole sequences (the depths: docs/design.md §1; the simulated
acceptance length: docs/design.md §6).

Depth d (0-based) at position t reads ``g_d[t]`` and token ``x[t+d+1]`` and predicts
``x[t+d+2]``. With packed sequences a target is used only when ``x[t]`` and ``x[t+d+2]`` belong
to the same document (documents are contiguous, so nothing in between crosses either).

Two objectives per depth, mixed by depth weights w_d (normalised beta^d by default):

* ``ce``: cross-entropy to the true next-next token;
* ``kl``: self-distillation, KL(p_backbone || q_d), where p_backbone is the backbone's own
  distribution for the same token (its logits at position t+d+1). This is what acceptance
  measures: how often the drafter agrees with the target.

Evaluation numbers are what serving sees: per-depth top-1 agreement with the backbone's
greedy token, and the simulated acceptance length 1 + sum_k prod_{j<=k} acc_j.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkfw.errors import ConfigError
from inkfw.speculative.metrics import simulated_acceptance_length


def depth_weights(num_depths: int, beta: float = 0.7, weights: Sequence[float] | None = None) -> torch.Tensor:
    """[D] weights summing to 1: ``weights`` normalised, or beta^d normalised."""
    if weights is not None:
        w = torch.tensor([float(x) for x in weights])
        if w.numel() != num_depths or bool((w < 0).any()) or float(w.sum()) <= 0:
            raise ConfigError(
                f"loss.weights must be {num_depths} non-negative numbers with a positive sum, got {list(weights)}."
            )
    else:
        if not 0 < beta <= 1:
            raise ConfigError(f"loss.beta must lie in (0, 1], got {beta}.")
        w = torch.tensor([beta**d for d in range(num_depths)])
    return w / w.sum()


def target_mask(doc_ids: torch.Tensor, offset: int) -> torch.Tensor:
    """[B, T] bool: position t has a target ``offset`` tokens ahead in the same document."""
    B, T = doc_ids.shape
    mask = torch.zeros(B, T, dtype=torch.bool, device=doc_ids.device)
    if offset < T:
        mask[:, : T - offset] = doc_ids[:, : T - offset] == doc_ids[:, offset:]
    return mask


@dataclass
class DepthStats:
    loss: torch.Tensor  # scalar, weighted sum over trained depths (differentiable)
    ce: list[torch.Tensor]  # per depth, detached
    kl: list[torch.Tensor]  # per depth, detached
    agreement: list[torch.Tensor]  # per depth: top-1 == backbone greedy token
    num_targets: list[int]

    @property
    def simulated_acceptance_length(self) -> float:
        return simulated_acceptance_length([float(a) for a in self.agreement])


@torch.no_grad()
def _backbone_outputs(
    model, input_ids: torch.Tensor, hidden: torch.Tensor | None, backbone_logits: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [B, T, H] as given or computed, backbone logits [B, T, V] in float32, their argmax [B, T])."""
    h: torch.Tensor = model(input_ids) if hidden is None else hidden  # [B, T, H]
    logits: torch.Tensor = model.logits(h) if backbone_logits is None else backbone_logits
    logits = logits.detach().float()  # [B, T, V]
    return h, logits, logits.argmax(-1)


def mtp_losses(
    model,
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    *,
    num_depths: int | None = None,
    train_from: int = 0,
    weights: torch.Tensor | None = None,
    objective: str = "ce",
    hidden: torch.Tensor | None = None,
    backbone_logits: torch.Tensor | None = None,
) -> DepthStats:
    """Losses of depths ``[train_from, num_depths)`` (earlier depths run, but are not in the loss).

    ``input_ids`` [B, T]; ``doc_ids`` [B, T] document index of every token (None: one
    document per row). ``hidden`` / ``backbone_logits``: the backbone's final hidden states and
    logits [B, T, V] if already computed.
    """
    if objective not in ("ce", "kl"):
        raise ConfigError(f"loss.objective must be 'ce' or 'kl', got {objective!r}.")
    D = model.num_mtp_depths if num_depths is None else num_depths
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    if weights is None:
        weights = depth_weights(D)
    hidden, backbone_logits, backbone_greedy = _backbone_outputs(model, input_ids, hidden, backbone_logits)
    chain = model.mtp_chain(hidden, input_ids, D, frozen_depths=train_from)  # g_1 .. g_D, each [B, T, H]

    loss = hidden.new_zeros((), dtype=torch.float32)
    ce_out, kl_out, agree_out, counts = [], [], [], []
    for d, g in enumerate(chain):
        mask = target_mask(doc_ids, d + 2)  # [B, T]
        n = int(mask.sum())
        counts.append(n)
        if n == 0:
            zero = loss.detach() * 0
            ce_out.append(zero)
            kl_out.append(zero)
            agree_out.append(zero)
            continue
        logits = model.logits(g[mask]).float()  # [N, V]
        targets = input_ids[:, d + 2 :][mask[:, : input_ids.shape[1] - d - 2]]  # [N]
        teacher = backbone_logits[:, d + 1 :][mask[:, : input_ids.shape[1] - d - 1]]  # [N, V]
        ce = F.cross_entropy(logits, targets)
        kl = F.kl_div(logits.log_softmax(-1), teacher.log_softmax(-1), log_target=True, reduction="batchmean")
        greedy = backbone_greedy[:, d + 1 :][mask[:, : input_ids.shape[1] - d - 1]]
        agree = (logits.argmax(-1) == greedy).float().mean()
        if d >= train_from:
            loss = loss + weights[d].to(loss.device) * (ce if objective == "ce" else kl)
        ce_out.append(ce.detach())
        kl_out.append(kl.detach())
        agree_out.append(agree.detach())
    return DepthStats(loss, ce_out, kl_out, agree_out, counts)
