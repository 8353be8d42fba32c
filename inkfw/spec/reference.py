"""Uncached draft reference: every depth recomputed from scratch over the whole sequence.

Slow and obviously correct; the engine's cached drafter is checked against it.
"""

from __future__ import annotations

import torch

from inkfw.models.inkling.model import InklingLM, default_positions


@torch.no_grad()
def greedy_reference_drafts(model: InklingLM, ids: torch.Tensor, num_steps: int | None = None,
                            hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy drafts after the committed sequence ``ids`` [B, N].

    The target's next token x[N] = b comes first (as after a verify step); then step s uses
    depth s over positions 0..N-1 with tokens x[t+s+1] (earlier drafts appended) and the
    previous step's hidden states, and drafts from the last position. Returns
    ``[b, d_1, ..., d_k]`` as [B, 1 + k]; k = ``num_steps`` <= depths (prefill steps only).
    ``hidden``: the target's uncached hidden states of ``ids`` when the caller already has them.
    """
    depths = model.num_mtp_depths
    k = depths if num_steps is None else num_steps
    if not 0 <= k <= depths:
        raise ValueError(f"num_steps must lie in [0, {depths}], got {k}")
    N = ids.shape[1]
    positions = default_positions(ids)
    g = model(ids, positions) if hidden is None else hidden  # [B, N, H]
    tokens = torch.cat([ids, model.logits(g[:, -1]).argmax(-1, keepdim=True)], dim=1)  # [B, N + 1]
    for s in range(k):
        g = model.mtp_step(s, g, tokens[:, s + 1: s + 1 + N], positions)  # [B, N, H]
        tokens = torch.cat([tokens, model.logits(g[:, -1]).argmax(-1, keepdim=True)], dim=1)
    return tokens[:, N:]
