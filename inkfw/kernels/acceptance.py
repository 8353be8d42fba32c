"""Acceptance of draft tokens against the target, in Triton (docs/design.md §3).

Two rules over ragged drafts, each next to its torch reference (the functions of
:mod:`inkfw.speculative.acceptance`, re-exported here under ``*_reference``):

- :func:`greedy_accept_triton` (``draft_tokens`` [B, k], ``target_logits`` [B, k+1, V],
  ``num_drafts`` [B] or None): the longest prefix of drafts equal to the target's argmax, and the
  argmax after it (the bonus token);
- :func:`rejection_sample_triton` (``draft_tokens`` [B, k], ``draft_probs`` q [B, k, V] or None,
  ``target_probs`` p [B, k+1, V], ``uniforms`` [B, k] float64, ``noise`` [B, V] float32 Exp(1),
  ``num_drafts``): draft i is accepted iff ``u_i * q_i(d_i) < p_i(d_i)`` (in float64); the next
  token is the exponential race ``argmax(dist / noise)`` (in float32) over the residual
  ``max(p - q, 0)`` at the first rejection (p if that has no mass; q one-hot at the draft when
  ``draft_probs`` is None) or over p at position ``num_drafts`` when every draft passed.

Both return ``(num_accepted [B], next_token [B])``, long. Given the same draws the results equal
the references bit for bit: the same casts, IEEE division, and torch.argmax's order (the first
index on ties, NaN above everything).

Work split: the vocabulary is cut into ``num_splits`` chunks of ``BLOCK_V * BLOCKS_PER_SPLIT``
entries, all functions of V alone. A partial kernel, one program per (row [, position], chunk),
reduces its chunk to a candidate (value, first index); a finalize kernel, one program per row,
combines the chunks' candidates and writes the outputs. Grids depend only on shapes, and with
``check=False`` nothing is read back to the host.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from inkfw.speculative.acceptance import (
    _check_shapes,
    _draft_mask,
    check_rejection_shapes,
    greedy_accept,
    rejection_sample,
)

greedy_accept_reference = greedy_accept
rejection_sample_reference = rejection_sample

MAX_BLOCK_V = 2048  # vocabulary entries one program loads at once
MAX_BLOCKS_PER_SPLIT = 4  # blocks one program loops over: chunks of up to 8192 entries
NO_INDEX: tl.constexpr = tl.constexpr(2**31 - 1)  # the index of "no candidate", above every real one


def _vocab_split(V: int) -> tuple[int, int, int]:
    """(BLOCK_V, BLOCKS_PER_SPLIT, num_splits) for a vocabulary of V entries."""
    block = min(MAX_BLOCK_V, triton.next_power_of_2(V))
    per_split = min(MAX_BLOCKS_PER_SPLIT, triton.cdiv(V, block))
    return block, per_split, triton.cdiv(V, block * per_split)


@triton.jit
def _argmax_fold(values, index, mask, best_value, best_index, AXIS):  # AXIS: a literal, so constexpr
    """Folds the entries of ``values`` where ``mask`` (at ``index``) along AXIS into the running
    candidate ``(best_value, best_index)`` (start from (-inf, NO_INDEX)), in torch.argmax's
    order: a NaN above everything, then larger values, then smaller indices. Returns the new
    candidate; its value is NaN when a NaN won. NaNs are taken out before tl.max, whose NaN
    handling differs between the GPU and the interpreter."""
    is_nan = (values != values) & mask
    ordered = tl.where(mask & (values == values), values, float("-inf"))
    # (the annotations: the stubs type reductions as tensor-or-tuple)
    top: tl.tensor = tl.max(ordered, axis=AXIS)  # type: ignore[assignment]
    nan_count: tl.tensor = tl.max(is_nan.to(tl.int32), axis=AXIS)  # type: ignore[assignment]
    if AXIS == 0:
        winner = tl.where(nan_count > 0, is_nan, mask & (ordered == top))
    else:
        winner = tl.where(nan_count[:, None] > 0, is_nan, mask & (ordered == top[:, None]))
    first: tl.tensor = tl.min(tl.where(winner, index, NO_INDEX), axis=AXIS)  # type: ignore[assignment]
    # the block's candidate against the running one (which holds the smaller indices on ties
    # when blocks come in order; the index test makes the fold order-free anyway)
    earlier = first < best_index
    old_nan = best_value != best_value
    old_number = best_value == best_value
    take = (
        ((nan_count > 0) & old_number)
        | ((nan_count > 0) & old_nan & earlier)
        | ((nan_count == 0) & old_number & ((top > best_value) | ((top == best_value) & earlier)))
    )
    value = tl.where(nan_count > 0, float("nan"), top)
    return tl.where(take, value, best_value), tl.where(take, first, best_index)


# ---------------------------------------------------------------------------------------------------
# greedy


@triton.jit
def _greedy_partial_kernel(
    logits_ptr,  # [B, k+1, V]
    stride_lb,
    stride_lk,
    stride_lv,
    part_value_ptr,  # [B * (k+1), num_splits] candidate value per chunk
    part_index_ptr,  # [B * (k+1), num_splits] int32 its index
    K1,  # k + 1
    V,
    num_splits,
    BLOCK_V: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
):
    row = tl.program_id(0)  # b * (k+1) + position
    split = tl.program_id(1)
    b = row // K1
    i = row % K1
    base = logits_ptr + b.to(tl.int64) * stride_lb + i.to(tl.int64) * stride_lk
    acc_type = part_value_ptr.dtype.element_ty  # fp32 (fp64 for fp64 logits): order-preserving
    best_value = tl.full((), float("-inf"), acc_type)
    best_index = tl.full((), NO_INDEX, tl.int32)
    start = split * (BLOCK_V * BLOCKS_PER_SPLIT)
    for j in range(BLOCKS_PER_SPLIT):
        offs = start + j * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = offs < V
        x = tl.load(base + offs.to(tl.int64) * stride_lv, mask=mask, other=0.0).to(acc_type)
        best_value, best_index = _argmax_fold(x, offs, mask, best_value, best_index, 0)
    out = row.to(tl.int64) * num_splits + split
    tl.store(part_value_ptr + out, best_value)
    tl.store(part_index_ptr + out, best_index)


@triton.jit
def _greedy_finalize_kernel(
    draft_ptr,  # [B, k]
    stride_db,
    stride_dk,
    counts_ptr,  # [B] (unread without HAS_COUNTS)
    part_value_ptr,  # [B * (k+1), num_splits]
    part_index_ptr,
    num_accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    K,
    num_splits,
    HAS_COUNTS: tl.constexpr,
    K1_P2: tl.constexpr,  # next power of two >= k + 1
    SPLITS_P2: tl.constexpr,
):
    b = tl.program_id(0)
    pos = tl.arange(0, K1_P2)  # [K1_P2] target positions 0 .. k
    chunk = tl.arange(0, SPLITS_P2)
    n = K
    if HAS_COUNTS:
        n = tl.minimum(tl.maximum(tl.load(counts_ptr + b).to(tl.int32), 0), K)  # as _draft_mask
    rows = (b * (K + 1) + pos).to(tl.int64)  # [K1_P2]
    at = rows[:, None] * num_splits + chunk[None, :]  # [K1_P2, SPLITS_P2]
    mask = (pos[:, None] <= K) & (chunk[None, :] < num_splits)
    value = tl.load(part_value_ptr + at, mask=mask, other=0.0)
    index = tl.load(part_index_ptr + at, mask=mask, other=NO_INDEX)
    no_value = tl.full((K1_P2,), float("-inf"), value.dtype)
    no_index = tl.full((K1_P2,), NO_INDEX, tl.int32)
    _, target = _argmax_fold(value, index, mask, no_value, no_index, 1)  # [K1_P2] argmax per position
    drafts = tl.load(draft_ptr + b.to(tl.int64) * stride_db + pos.to(tl.int64) * stride_dk, mask=pos < n, other=-1)
    match = (pos < n) & (drafts == target.to(drafts.dtype))  # [K1_P2]
    # the first miss (every pos >= n misses)
    accepted: tl.tensor = tl.min(tl.where(match, K1_P2, pos), axis=0)  # type: ignore[assignment]
    bonus = tl.sum(tl.where(pos == accepted, target, 0), axis=0)
    tl.store(num_accepted_ptr + b, accepted.to(tl.int64))
    tl.store(next_token_ptr + b, bonus.to(tl.int64))


def greedy_accept_triton(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification, as :func:`inkfw.speculative.acceptance.greedy_accept`.

    ``draft_tokens`` [B, k], ``target_logits`` [B, k+1, V], ``num_drafts`` [B] (None: all k;
    counts outside [0, k] are clamped into it, as the reference's mask does). ``check`` validates
    the counts on the host. Returns ``(num_accepted [B], bonus [B])``, both long.
    """
    B, k = _check_shapes(draft_tokens, target_logits)
    V = target_logits.shape[-1]
    device = target_logits.device
    if V == 0:
        raise ValueError("target_logits has an empty vocabulary (V = 0)")
    if num_drafts is not None and (check or num_drafts.shape != (B,)):
        _draft_mask(num_drafts, B, k, device, check)  # the reference's errors (range: a host read)
    num_accepted = torch.empty(B, dtype=torch.long, device=device)
    next_token = torch.empty(B, dtype=torch.long, device=device)
    if B == 0:
        return num_accepted, next_token
    draft_tokens = draft_tokens.to(device)
    block, per_split, num_splits = _vocab_split(V)
    acc_dtype = torch.float64 if target_logits.dtype == torch.float64 else torch.float32
    part_value = torch.empty(B * (k + 1), num_splits, dtype=acc_dtype, device=device)
    part_index = torch.empty(B * (k + 1), num_splits, dtype=torch.int32, device=device)
    partial_kernel: Any = _greedy_partial_kernel  # launched with constexpr keywords pyright cannot type
    partial_kernel[(B * (k + 1), num_splits)](
        target_logits,
        *target_logits.stride(),
        part_value,
        part_index,
        k + 1,
        V,
        num_splits,
        BLOCK_V=block,
        BLOCKS_PER_SPLIT=per_split,
    )
    counts = num_drafts.to(device) if num_drafts is not None else num_accepted  # unread without counts
    finalize_kernel: Any = _greedy_finalize_kernel
    finalize_kernel[(B,)](
        *_operand(draft_tokens, num_accepted),
        counts,
        part_value,
        part_index,
        num_accepted,
        next_token,
        k,
        num_splits,
        HAS_COUNTS=num_drafts is not None,
        K1_P2=triton.next_power_of_2(k + 1),
        SPLITS_P2=triton.next_power_of_2(num_splits),
    )
    return num_accepted, next_token


def _operand(t: torch.Tensor, stand_in: torch.Tensor) -> tuple[torch.Tensor | int, ...]:
    """``(t, *t.stride())``, or ``stand_in`` with zero strides when ``t`` holds nothing (k = 0: the
    kernel reads none of it, and an empty tensor's pointer may be null)."""
    return (t, *t.stride()) if t.numel() else (stand_in, *([0] * t.dim()))


# ---------------------------------------------------------------------------------------------------
# rejection sampling


@triton.jit
def _accepted_prefix(
    draft_ptr,
    stride_db,
    stride_dk,
    counts_ptr,
    p_ptr,
    stride_pb,
    stride_pk,
    stride_pv,
    q_ptr,
    stride_qb,
    stride_qk,
    stride_qv,
    u_ptr,
    stride_ub,
    stride_uk,
    b,
    K,
    V,
    HAS_COUNTS: tl.constexpr,
    HAS_Q: tl.constexpr,
    K_P2: tl.constexpr,
):
    """Row b's (num_accepted, num_drafts, draft at num_accepted): draft i passes iff
    ``u_i * q_i(d_i) < p_i(d_i)`` in float64, as the reference (q_i(d_i) = 1 without q)."""
    slot = tl.arange(0, K_P2)
    n = K
    if HAS_COUNTS:
        n = tl.minimum(tl.maximum(tl.load(counts_ptr + b).to(tl.int32), 0), K)  # as _draft_mask
    valid = slot < n  # [K_P2]
    b64 = b.to(tl.int64)
    slot64 = slot.to(tl.int64)
    drafts = tl.load(draft_ptr + b64 * stride_db + slot64 * stride_dk, mask=valid, other=0).to(tl.int64)
    inside = valid & (drafts >= 0) & (drafts < V)  # out-of-range drafts (check=True rejects them) read nothing
    drafts = tl.where(inside, drafts, 0)
    p_d = tl.load(p_ptr + b64 * stride_pb + slot64 * stride_pk + drafts * stride_pv, mask=inside, other=0.0)
    p_d = p_d.to(tl.float64)
    if HAS_Q:
        q_d = tl.load(q_ptr + b64 * stride_qb + slot64 * stride_qk + drafts * stride_qv, mask=inside, other=1.0)
        q_d = q_d.to(tl.float64)
    else:
        q_d = tl.full((K_P2,), 1.0, tl.float64)
    u = tl.load(u_ptr + b64 * stride_ub + slot64 * stride_uk, mask=valid, other=1.0).to(tl.float64)
    accept = valid & (u * q_d < p_d)  # [K_P2] u < p / q without dividing by q
    # the first failure (every slot >= n fails)
    accepted: tl.tensor = tl.min(tl.where(accept, K_P2, slot), axis=0)  # type: ignore[assignment]
    draft_at = tl.sum(tl.where(slot == accepted, drafts, 0), axis=0)  # the rejected draft, if any
    return accepted, n, draft_at


@triton.jit
def _rejection_partial_kernel(
    draft_ptr,
    stride_db,
    stride_dk,
    counts_ptr,
    p_ptr,  # [B, k+1, V]
    stride_pb,
    stride_pk,
    stride_pv,
    q_ptr,  # [B, k, V] (unread without HAS_Q)
    stride_qb,
    stride_qk,
    stride_qv,
    u_ptr,  # [B, k]
    stride_ub,
    stride_uk,
    noise_ptr,  # [B, V]
    stride_nb,
    stride_nv,
    num_accepted_ptr,  # [B] int64 out (written by chunk 0)
    part_ptr,  # [B, num_splits, 3] fp32: race value over the residual, over p; 1.0 if the residual is used
    part_index_ptr,  # [B, num_splits, 2] int32: race index over the residual, over p
    K,
    V,
    num_splits,
    HAS_COUNTS: tl.constexpr,
    HAS_Q: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    split = tl.program_id(1)
    accepted, n, draft_at = _accepted_prefix(
        draft_ptr,
        stride_db,
        stride_dk,
        counts_ptr,
        p_ptr,
        stride_pb,
        stride_pk,
        stride_pv,
        q_ptr,
        stride_qb,
        stride_qk,
        stride_qv,
        u_ptr,
        stride_ub,
        stride_uk,
        b,
        K,
        V,
        HAS_COUNTS,
        HAS_Q,
        K_P2,
    )
    tl.store(num_accepted_ptr + b, accepted.to(tl.int64), mask=split == 0)
    rejected = accepted < n  # then the next token comes from the residual at slot `accepted`
    b64 = b.to(tl.int64)
    p_row = p_ptr + b64 * stride_pb + accepted.to(tl.int64) * stride_pk
    q_row = q_ptr + b64 * stride_qb + accepted.to(tl.int64) * stride_qk  # read only when rejected
    noise_row = noise_ptr + b64 * stride_nb
    q_end = tl.where(rejected, V, 0)  # q is read only for a rejected draft
    r_value = tl.full((), float("-inf"), tl.float32)
    r_index = tl.full((), NO_INDEX, tl.int32)
    p_value = tl.full((), float("-inf"), tl.float32)
    p_index = tl.full((), NO_INDEX, tl.int32)
    mass = tl.full((), 0, tl.int32)
    start = split * (BLOCK_V * BLOCKS_PER_SPLIT)
    for j in range(BLOCKS_PER_SPLIT):
        offs = start + j * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        mask = offs < V
        offs64 = offs.to(tl.int64)
        p = tl.load(p_row + offs64 * stride_pv, mask=mask, other=0.0).to(tl.float32)
        if HAS_Q:
            q_mask = offs < q_end  # [BLOCK_V] (`mask & rejected` as one vector compare)
            q = tl.load(q_row + offs64 * stride_qv, mask=q_mask, other=0.0).to(tl.float32)
        else:
            q = tl.where(offs64 == draft_at, 1.0, 0.0)  # one-hot at the rejected draft
        diff = p - q
        residual = tl.where(diff < 0.0, 0.0, diff)  # clamp_min(0): keeps a NaN, as torch does
        # The reference calls the residual empty iff its fp32 sum over V is <= 0. Every entry is
        # >= 0 or NaN; fp32 addition of non-negative terms never decreases a partial sum
        # (round-to-nearest is monotone and x + y >= x), so the sum is >= its largest entry: it is
        # <= 0 exactly when every entry is 0. A NaN or inf makes the sum NaN or inf (NaN <= 0 is
        # False). So "empty" is the same boolean as "no entry != 0", whatever the summation order.
        mass = tl.maximum(mass, tl.max((mask & (residual != 0.0)).to(tl.int32), axis=0))
        noise = tl.load(noise_row + offs64 * stride_nv, mask=mask, other=1.0).to(tl.float32)
        # the race over both, IEEE division as torch's
        r_value, r_index = _argmax_fold(tl.div_rn(residual, noise), offs, mask, r_value, r_index, 0)
        p_value, p_index = _argmax_fold(tl.div_rn(p, noise), offs, mask, p_value, p_index, 0)
    out = b64 * num_splits + split
    tl.store(part_ptr + out * 3, r_value)
    tl.store(part_ptr + out * 3 + 1, p_value)
    tl.store(part_ptr + out * 3 + 2, ((mass > 0) & rejected).to(tl.float32))
    tl.store(part_index_ptr + out * 2, r_index)
    tl.store(part_index_ptr + out * 2 + 1, p_index)


@triton.jit
def _rejection_finalize_kernel(
    part_ptr,  # [B, num_splits, 3]
    part_index_ptr,  # [B, num_splits, 2]
    next_token_ptr,  # [B] int64 out
    num_splits,
    SPLITS_P2: tl.constexpr,
):
    b = tl.program_id(0)
    chunk = tl.arange(0, SPLITS_P2)
    mask = chunk < num_splits
    at = b.to(tl.int64) * num_splits + chunk  # [SPLITS_P2]
    residual_used: tl.tensor = tl.max(tl.load(part_ptr + at * 3 + 2, mask=mask, other=0.0), axis=0)  # type: ignore[assignment]
    r_value = tl.load(part_ptr + at * 3, mask=mask, other=0.0)
    r_index = tl.load(part_index_ptr + at * 2, mask=mask, other=NO_INDEX)
    p_value = tl.load(part_ptr + at * 3 + 1, mask=mask, other=0.0)
    p_index = tl.load(part_index_ptr + at * 2 + 1, mask=mask, other=NO_INDEX)
    no_value = tl.full((), float("-inf"), tl.float32)
    no_index = tl.full((), NO_INDEX, tl.int32)
    _, from_residual = _argmax_fold(r_value, r_index, mask, no_value, no_index, 0)
    _, from_p = _argmax_fold(p_value, p_index, mask, no_value, no_index, 0)
    tl.store(next_token_ptr + b, tl.where(residual_used > 0.0, from_residual, from_p).to(tl.int64))


def rejection_sample_triton(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    noise: torch.Tensor,
    num_drafts: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless speculative sampling, as :func:`inkfw.speculative.acceptance.rejection_sample`
    (docs/design.md §3), equal to it bit for bit given the same ``uniforms`` and ``noise``.

    ``draft_tokens`` [B, k]; ``draft_probs`` q [B, k, V] or None (greedy drafts); ``target_probs``
    p [B, k+1, V]; ``uniforms`` [B, k] (float64; any float dtype is widened to it, as the reference
    does); ``noise`` [B, V] Exp(1) (float32, or a narrower float); ``num_drafts`` [B] (None: all k;
    counts outside [0, k] are clamped into it). ``check`` validates the counts and the real drafts'
    token ids on the host; without it an out-of-range draft reads nothing and is rejected.
    Returns ``(num_accepted [B], next_token [B])``, both long.
    """
    B, k, V = check_rejection_shapes(draft_tokens, draft_probs, target_probs, uniforms, noise)
    device = target_probs.device
    if noise.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"noise must be float32 (the race divides in float32), got {noise.dtype}")
    if not uniforms.is_floating_point():
        raise ValueError(f"uniforms must be floating point (float64), got {uniforms.dtype}")
    if V == 0:
        raise ValueError("target_probs has an empty vocabulary (V = 0)")
    if check:  # host reads
        valid = _draft_mask(num_drafts, B, k, device)  # [B, k]
        if bool(((draft_tokens.to(device) < 0) | (draft_tokens.to(device) >= V))[valid].any()):
            raise ValueError(f"draft_tokens must lie in [0, {V}) where drafts are real")
    elif num_drafts is not None and num_drafts.shape != (B,):
        _draft_mask(num_drafts, B, k, device, check)  # the reference's error
    num_accepted = torch.empty(B, dtype=torch.long, device=device)
    next_token = torch.empty(B, dtype=torch.long, device=device)
    if B == 0:
        return num_accepted, next_token
    draft_tokens = draft_tokens.to(device)
    uniforms = uniforms.to(device)
    noise = noise.to(device)
    q = draft_probs.to(device) if draft_probs is not None else target_probs  # unread without q
    counts = num_drafts.to(device) if num_drafts is not None else num_accepted  # unread without counts
    block, per_split, num_splits = _vocab_split(V)
    part = torch.empty(B, num_splits, 3, dtype=torch.float32, device=device)
    part_index = torch.empty(B, num_splits, 2, dtype=torch.int32, device=device)
    partial_kernel: Any = _rejection_partial_kernel  # launched with constexpr keywords pyright cannot type
    partial_kernel[(B, num_splits)](
        *_operand(draft_tokens, num_accepted),
        counts,
        target_probs,
        *target_probs.stride(),
        *_operand(q, target_probs),
        *_operand(uniforms, noise),
        noise,
        *noise.stride(),
        num_accepted,
        part,
        part_index,
        k,
        V,
        num_splits,
        HAS_COUNTS=num_drafts is not None,
        HAS_Q=draft_probs is not None,
        K_P2=triton.next_power_of_2(max(k, 1)),
        BLOCK_V=block,
        BLOCKS_PER_SPLIT=per_split,
    )
    finalize_kernel: Any = _rejection_finalize_kernel
    finalize_kernel[(B,)](part, part_index, next_token, num_splits, SPLITS_P2=triton.next_power_of_2(num_splits))
    return num_accepted, next_token
