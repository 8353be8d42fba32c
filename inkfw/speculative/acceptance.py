"""Verification of draft tokens against the target: greedy acceptance and rejection sampling.

The target has scored ``[x_n, d_1 .. d_k]``, so its position i (0-based) is the distribution
of the token after ``d_1 .. d_i``: k + 1 positions per row. Rows may carry fewer drafts than
the batch width k (``num_drafts[b] <= k``); entries beyond are padding, may hold any value and
are never accepted. A row with 0 drafts is plain decoding from the target's position 0.

Both rules return ``(num_accepted [B], next_token [B])``: the row emits its first
``num_accepted`` drafts and then ``next_token`` (the bonus token, or the replacement for the
first rejected draft), i.e. ``num_accepted + 1`` tokens; :func:`emitted_tokens` lays them out.
Both are pure functions: rejection sampling takes its random numbers as arguments (the
sampler draws them from each request's generator), so one set of inputs has one answer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inkfw.speculative.sampling import sample_with_noise


def _draft_mask(
    num_drafts: torch.Tensor | None, batch: int, k: int, device: torch.device, check: bool = True
) -> torch.Tensor:
    """[B, k] bool: which draft slots hold a real draft. ``check`` validates the counts (a host
    read; the engine's step passes False, its counts are right by construction)."""
    slots = torch.arange(k, device=device)[None, :]  # [1, k]
    if num_drafts is None:
        return (slots < k).expand(batch, k)
    if num_drafts.shape != (batch,):
        raise ValueError(f"num_drafts must have shape [{batch}], got {list(num_drafts.shape)}")
    if check and num_drafts.numel() and (int(num_drafts.min()) < 0 or int(num_drafts.max()) > k):
        raise ValueError(f"num_drafts must lie in [0, {k}], got {num_drafts.tolist()}")
    return slots < num_drafts.to(device)[:, None]


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, k], got {list(draft_tokens.shape)}")
    B, k = draft_tokens.shape
    if target.dim() != 3 or target.shape[:2] != (B, k + 1):
        raise ValueError(f"target must be [B={B}, k+1={k + 1}, V], got {list(target.shape)}")
    return B, k


def check_rejection_shapes(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[int, int, int]:
    """(B, k, V) of :func:`rejection_sample`'s arguments, or ValueError naming the one that is off."""
    B, k = _check_shapes(draft_tokens, target_probs)
    V = target_probs.shape[-1]
    if draft_probs is not None and draft_probs.shape != (B, k, V):
        raise ValueError(f"draft_probs must be [B={B}, k={k}, V={V}], got {list(draft_probs.shape)}")
    if uniforms.shape != (B, k):
        raise ValueError(f"uniforms must be [B={B}, k={k}], got {list(uniforms.shape)}")
    if noise.shape != (B, V):
        raise ValueError(f"noise must be [B={B}, V={V}], got {list(noise.shape)}")
    return B, k, V


def _accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """[B] length of the all-True prefix of ``accept`` [B, k]."""
    return accept.long().cumprod(dim=-1).sum(dim=-1)


def greedy_accept(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification.

    ``draft_tokens`` [B, k], ``target_logits`` [B, k+1, V] (probabilities work too: only the
    argmax is used), ``num_drafts`` [B] (None: all k). Accepts the longest prefix of drafts
    equal to the target's argmax; the bonus is the target's argmax after the last accepted
    draft. Returns ``(num_accepted [B], bonus [B])``, both long.
    """
    B, k = _check_shapes(draft_tokens, target_logits)
    valid = _draft_mask(num_drafts, B, k, draft_tokens.device, check)  # [B, k]
    target_tokens = target_logits.argmax(dim=-1)  # [B, k+1]
    match = (draft_tokens == target_tokens[:, :k]) & valid  # [B, k]
    num_accepted = _accepted_prefix(match)  # [B]
    bonus = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return num_accepted, bonus


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to sample after a rejection: ``max(p - q, 0)`` [B, V] (unnormalised), or ``p``
    for rows where that has no mass (p <= q everywhere, i.e. p == q up to rounding)."""
    r = (p - q).clamp_min(0)  # [B, V]
    empty = r.sum(dim=-1, keepdim=True) <= 0  # [B, 1]
    return torch.where(empty, p, r)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling (Leviathan et al. / Chen et al.; docs/design.md §3).

    ``draft_tokens`` [B, k]; ``draft_probs`` q [B, k, V], the distributions the drafts were
    sampled from (None: greedy drafts, q one-hot at each draft); ``target_probs`` p
    [B, k+1, V], already processed (:meth:`~inkfw.speculative.sampling.Sampler.probs`);
    ``uniforms`` [B, k] in [0, 1) and ``noise`` [B, V] Exp(1), the step's random numbers
    (:meth:`~inkfw.speculative.sampling.Sampler.acceptance_draws`); ``num_drafts`` [B]
    (None: all k). A pure function: the same inputs give the same outputs.

    Draft i is accepted iff u_i < p_i(d_i) / q_i(d_i), i.e. with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is sampled from
    normalise(max(p_i - q_i, 0)) (p_i if that is all zero); if all of a row's drafts pass, the
    bonus is sampled from p at position ``num_drafts``. Sampling is the exponential race
    ``argmax(dist / noise)``. The emitted tokens are then distributed exactly as sampling from
    p token by token.

    Returns ``(num_accepted [B], next_token [B])``, both long.
    """
    B, k, V = check_rejection_shapes(draft_tokens, draft_probs, target_probs, uniforms, noise)
    device = target_probs.device
    valid = _draft_mask(num_drafts, B, k, device, check)  # [B, k]
    counts = valid.sum(dim=-1)  # [B] drafts per row
    drafts = torch.where(valid, draft_tokens.to(device), 0)  # [B, k] padding -> a safe index

    p_d = target_probs[:, :k].gather(-1, drafts[..., None]).squeeze(-1).double()  # [B, k] p_i(d_i)
    if draft_probs is None:
        q_d = torch.ones_like(p_d)  # [B, k]
    else:
        q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1).double()  # [B, k] q_i(d_i)
    accept = (uniforms.to(device) * q_d < p_d) & valid  # [B, k]  u < p/q, without dividing by q
    num_accepted = _accepted_prefix(accept)  # [B]

    rows = torch.arange(B, device=device)
    p_next = target_probs[rows, num_accepted].float()  # [B, V] target at the first unaccepted slot
    dist = p_next
    if k > 0:
        rejected = (num_accepted < counts)[:, None]  # [B, 1]
        at = num_accepted.clamp_max(k - 1)  # [B] the rejected slot (clamped rows are not rejected)
        if draft_probs is None:
            q_next = F.one_hot(drafts[rows, at], V).float()  # [B, V]
        else:
            q_next = draft_probs[rows, at].float()  # [B, V]
        dist = torch.where(rejected, _residual(p_next, q_next), p_next)  # [B, V]
    next_token = sample_with_noise(dist, noise.to(device))  # [B]
    return num_accepted, next_token


def emitted_tokens(
    draft_tokens: torch.Tensor, num_accepted: torch.Tensor, next_token: torch.Tensor, pad: int = -1
) -> torch.Tensor:
    """[B, k+1]: each row's accepted drafts, then ``next_token``, then ``pad``."""
    B, k = draft_tokens.shape
    slots = torch.arange(k + 1, device=draft_tokens.device)[None, :]  # [1, k+1]
    out = torch.cat(
        [draft_tokens, torch.full((B, 1), pad, dtype=draft_tokens.dtype, device=draft_tokens.device)], dim=1
    )  # [B, k+1]
    out = torch.where(slots < num_accepted[:, None], out, pad)
    return out.scatter(1, num_accepted[:, None], next_token[:, None].to(out.dtype))
