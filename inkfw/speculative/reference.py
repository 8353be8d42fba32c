"""Uncached draft reference: every depth recomputed from scratch over the whole sequence.

Slow and obviously correct; the engine's cached drafter is checked against it.
"""

from __future__ import annotations

import torch

from inkfw.cache.dense import DenseModelCache
from inkfw.models.inkling.model import default_positions
from inkfw.speculative.interfaces import TargetModel


@torch.no_grad()
def greedy_reference_drafts(
    model: TargetModel, ids: torch.Tensor, num_steps: int | None = None, hidden: torch.Tensor | None = None
) -> torch.Tensor:
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
        g = model.mtp_step(s, g, tokens[:, s + 1 : s + 1 + N], positions)  # [B, N, H]
        tokens = torch.cat([tokens, model.logits(g[:, -1]).argmax(-1, keepdim=True)], dim=1)
    return tokens[:, N:]


@torch.no_grad()
def reference_draft_logits(
    model: TargetModel, committed: torch.Tensor, drafts: torch.Tensor, num_prefill_steps: int, num_depths: int
) -> torch.Tensor:
    """Draft logits the engine must reproduce, recomputed from scratch for one request.

    ``committed`` [L] tokens, ``drafts`` [n] the drafts the engine chose (each step is fed the
    earlier ones, so sampled drafts can be checked too). Prefill steps s < P run depth s over
    positions 0..L-2 without a cache; decode steps s >= P (k > D) run depth s % D at position
    L-2 + s-P+1 on a fresh dense cache that holds only that depth's prefill step and its own
    earlier decode steps (positions it skipped are absent). Returns [n, V] float32.
    """
    L, n, P, D = committed.shape[0], drafts.shape[0], num_prefill_steps, num_depths
    if L < 2:
        raise ValueError("drafting needs at least two committed tokens")
    ids = torch.cat([committed, drafts]).long()[None]  # [1, L + n]
    N = L - 1
    positions = default_positions(ids[:, :N])
    decode = n > P
    caches = DenseModelCache(model, 1, N + n).mtp if decode else [None] * D
    g = model(ids[:, :N], positions)  # [1, N, H]
    out = []
    for s in range(min(n, P)):
        g = model.mtp_step(s, g, ids[:, s + 1 : s + 1 + N], positions, caches[s])
        out.append(model.logits(g[0, -1]).float())
    g_last = g[:, -1:]
    for s in range(P, n):
        pos = torch.full((1, 1), N - 1 + s - P + 1, device=ids.device)
        g_last = model.mtp_step(s % D, g_last, ids[:, L - 1 + s : L + s], pos, caches[s % D])
        out.append(model.logits(g_last[0, -1]).float())
    return torch.stack(out)
