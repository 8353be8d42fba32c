"""Paged span attention for Inkling: spans of T queries per request (verify spans, draft spans,
decode, prompt chunks) attend to keys and values read in place from a cache group's paged pools.

Inputs, for B rows of T queries with Hq query heads of size D and Hkv kv heads (GQA: query head
``h`` reads kv head ``h // (Hq // Hkv)``):

* ``q [B, T, Hq, D]``: per-head RMS-normed queries, not yet log-scaled;
* ``k_pool, v_pool [num_slots, Hkv, D]``: the group's pools (this step's keys/values written);
* ``slot_pos [num_slots]`` int64: the position each slot holds (``EMPTY_POSITION`` if none);
* ``table [B, W]`` int64, ``base [B]`` int64: the key at logical position
  ``p = (base[b] + c) * bs + o`` (column ``c < W``, offset ``o < bs``) lives in slot
  ``table[b, c] * bs + o`` and is readable iff ``table[b, c] >= 0`` and ``slot_pos[slot] == p``
  (stale, never written and invalidated slots fail this test);
* ``q_positions [B, T]`` int64: each query's absolute position;
* ``r [B, T, Hq, d_rel]``, ``rel_table [d_rel, E]``: the relative bias of a key at distance
  ``dist = q_pos - k_pos`` is ``r[b, t, h] @ rel_table[:, dist]`` for ``dist < E``, else 0;
* ``window``: a key is visible iff it is readable, ``dist >= 0`` and (``window`` is None or
  ``dist < window``);
* ``tau [B, T]`` fp32 or None: log scaling of global layers, multiplying both q and the bias.

Output ``[B, T, Hq, D]`` in q's dtype: ``softmax(scale * (tau q) . k + tau * bias) @ v`` over the
visible keys, in fp32; a query with no visible key (a padding row) gets zeros.

This is ``Attention.forward`` (``inkfw/models/inkling/layers.py``) over ``PagedLayerCache.update_kv``
and ``StepView.keys`` (``inkfw/cache/paged.py``) without gathering the pages into a contiguous copy
or building a dense bias and mask (docs/design.md §4).

The Triton version splits the ``W * bs`` logical key slots of each row over ``num_splits``
programs (flash-decoding): each runs an online softmax over tiles of keys and writes its partial
(max, sum, accumulator) in fp32, and a second small kernel combines them. One program handles all
query rows of one kv head (the T queries times the Hq // Hkv query heads that share it), so each
key tile is read once per kv head. Grid sizes depend only on shapes and nothing is read back to
the host (CUDA-graph friendly).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from inkfw.errors import ConfigError


def _check(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    base: torch.Tensor,
    q_positions: torch.Tensor,
    r: torch.Tensor,
    rel_table: torch.Tensor,
    tau: torch.Tensor | None,
) -> None:
    if q.dim() != 4:
        raise ConfigError(f"paged_span_attention: q must be [B, T, Hq, D], got shape {tuple(q.shape)}.")
    B, T, Hq, D = q.shape
    if k_pool.dim() != 3 or k_pool.shape != v_pool.shape or k_pool.shape[2] != D or Hq % k_pool.shape[1] != 0:
        raise ConfigError(
            f"paged_span_attention: k_pool and v_pool must both be [num_slots, Hkv, D={D}] with Hkv dividing "
            f"Hq={Hq}, got {tuple(k_pool.shape)} and {tuple(v_pool.shape)}."
        )
    if table.dim() != 2 or table.shape[0] != B or tuple(base.shape) != (B,):
        raise ConfigError(f"paged_span_attention: table must be [B={B}, W] and base [B={B}].")
    if tuple(q_positions.shape) != (B, T) or (tau is not None and tuple(tau.shape) != (B, T)):
        raise ConfigError(f"paged_span_attention: q_positions and tau must be [B={B}, T={T}].")
    if r.dim() != 4 or tuple(r.shape[:3]) != (B, T, Hq) or rel_table.dim() != 2 or rel_table.shape[0] != r.shape[3]:
        raise ConfigError(
            f"paged_span_attention: r must be [B={B}, T={T}, Hq={Hq}, d_rel] and rel_table [d_rel, E], got "
            f"{tuple(r.shape)} and {tuple(rel_table.shape)}."
        )


def paged_span_attention_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_pos: torch.Tensor,
    table: torch.Tensor,
    base: torch.Tensor,
    q_positions: torch.Tensor,
    r: torch.Tensor,
    rel_table: torch.Tensor,
    *,
    block_size: int,
    window: int | None,
    tau: torch.Tensor | None,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain-torch paged span attention (see the module docstring): gathers every key slot of the
    table, fp32 throughout, -> [B, T, Hq, D] in q's dtype. ``num_splits`` is ignored."""
    del num_splits  # the reference reduces over all keys at once
    _check(q, k_pool, v_pool, table, base, q_positions, r, rel_table, tau)
    B, T, Hq, D = q.shape
    W, Hkv, E, bs = table.shape[1], k_pool.shape[1], rel_table.shape[1], block_size
    offsets = torch.arange(bs, device=q.device)
    logical = ((base[:, None] + torch.arange(W, device=q.device))[:, :, None] * bs + offsets).reshape(B, W * bs)
    slots = (table[:, :, None] * bs + offsets).reshape(B, W * bs)  # [B, S]
    has_block = (table >= 0)[:, :, None].expand(B, W, bs).reshape(B, W * bs)
    slots = torch.where(has_block, slots, 0)
    readable = has_block & (slot_pos[slots] == logical)  # [B, S]

    group = Hq // Hkv
    keys = k_pool[slots].float().repeat_interleave(group, dim=2)  # [B, S, Hq, D]
    values = v_pool[slots].float().repeat_interleave(group, dim=2)  # [B, S, Hq, D]

    dist = q_positions[:, :, None] - logical[:, None, :]  # [B, T, S]
    visible = readable[:, None, :] & (dist >= 0)
    if window is not None:
        visible = visible & (dist < window)
    profile = r.float() @ rel_table.float()  # [B, T, Hq, E]
    columns = dist.clamp(0, E - 1)[:, :, None, :].expand(B, T, Hq, W * bs)
    bias = torch.where((dist < E)[:, :, None, :], profile.gather(-1, columns), 0.0)  # [B, T, Hq, S]

    qf = q.float()
    if tau is not None:
        qf = qf * tau.float()[:, :, None, None]
        bias = bias * tau.float()[:, :, None, None]
    scores = scale * torch.einsum("bthd,bshd->bths", qf, keys) + bias  # [B, T, Hq, S]
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)  # rows with no visible key: every weight is 0
    weights = torch.exp(scores - top)  # [B, T, Hq, S]
    total = weights.sum(-1, keepdim=True)
    out = torch.einsum("bths,bshd->bthd", weights, values) / torch.where(total > 0, total, 1.0)
    return out.to(q.dtype)


@triton.jit
def _span_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    slot_pos_ptr,
    table_ptr,
    base_ptr,
    qpos_ptr,
    bias_ptr,
    tau_ptr,
    out_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    T,
    Hq,
    Hkv,
    group,
    num_keys,
    head_dim,
    extent,
    window,
    scale,
    keys_per_split,
    num_splits,
    m_blocks,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tw,
    stride_pb,
    stride_pt,
    stride_fb,
    stride_ft,
    stride_fh,
    stride_taub,
    stride_taut,
    stride_ob,
    stride_ot,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_TAU: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    DIRECT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # program (row b, kv head, block of query rows) x split of the key slots
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m_block = pid % m_blocks
    kv_head = (pid // m_blocks) % Hkv
    b = (pid // m_blocks // Hkv).to(tl.int64)

    # query rows: (t, g) pairs t-major, g the query head within the kv head's group
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    row_ok = rows < T * group
    t = rows // group
    head = kv_head * group + rows % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim

    q_rows = q_ptr + b * stride_qb + t * stride_qt + head * stride_qh  # [M]
    q = tl.load(q_rows[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32)  # [M, D]
    # positions, distances and bias columns in int32: [M, N] int64 tiles spill registers
    q_pos = tl.load(qpos_ptr + b * stride_pb + t * stride_pt, mask=row_ok, other=0).to(tl.int32)  # [M]
    if HAS_TAU:
        tau = tl.load(tau_ptr + b * stride_taub + t * stride_taut, mask=row_ok, other=1.0).to(tl.float32)
        q = q * tau[:, None]
    q = q.to(k_ptr.dtype.element_ty)  # bf16/fp16 pools: tensor-core dot, fp32 accumulation
    bias_rows = bias_ptr + b * stride_fb + t * stride_ft + head * stride_fh  # [M]: (r @ rel_table) rows

    first_block = tl.load(base_ptr + b).to(tl.int32)  # logical block of table column 0
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, num_keys)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [N] logical key slots of the table
        n_ok = n < end
        column = n // BLOCK_SIZE
        offset = n % BLOCK_SIZE
        phys = tl.load(table_ptr + b * stride_tb + column * stride_tw, mask=n_ok, other=-1)
        k_pos = (first_block + column) * BLOCK_SIZE + offset  # [N]
        slot = phys * BLOCK_SIZE + offset
        has_block = n_ok & (phys >= 0)
        tag = tl.load(slot_pos_ptr + slot, mask=has_block, other=-1)
        readable = has_block & (tag == k_pos.to(tl.int64))  # [N]

        dist = q_pos[:, None] - k_pos[None, :]  # [M, N]
        visible = readable[None, :] & row_ok[:, None] & (dist >= 0)
        if HAS_WINDOW:
            visible = visible & (dist < window)

        kv_mask = readable[:, None] & d_ok[None, :]  # zeros elsewhere: an unread lane must not be NaN (0 * NaN)
        k = tl.load(
            k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :] * stride_kd, mask=kv_mask, other=0.0
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, N] fp32

        # relative bias: one gather from each query row's profile; only tiles with a visible key
        # inside the table's extent pay for it
        in_table = visible & (dist < extent)
        if tl.max(tl.max(in_table.to(tl.int32), axis=1), axis=0) != 0:
            bias = tl.load(bias_rows[:, None] + tl.where(in_table, dist, 0), mask=in_table, other=0.0)
            if HAS_TAU:
                bias = bias * tau[:, None]
            scores += bias
        scores = tl.where(visible, scores, float("-inf"))

        # online softmax; a row with no visible key so far keeps max -inf and weight 0
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])  # [M, N]
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :] * stride_vd, mask=kv_mask, other=0.0
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    if DIRECT:  # one split: normalise and write the output
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_rows = out_ptr + b * stride_ob + t * stride_ot + head * stride_oh
        tl.store(out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials [B, T, Hq, num_splits] and [B, T, Hq, num_splits, D], fp32
        part = ((b * T + t) * Hq + head) * num_splits + split  # [M]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * head_dim + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_splits_kernel(
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    out_ptr,
    T,
    Hq,
    head_dim,
    num_splits,
    stride_ob,
    stride_ot,
    stride_oh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # one program per query row (b, t, h): rescale every split to the common max and add
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    part = row * num_splits + s  # [S]
    split_max = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    top = tl.max(split_max, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp(split_max - top)  # [S]: 0 for splits that saw no visible key
    total = tl.sum(split_sum * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0, 1.0, total)  # [D]
    b = row // (T * Hq)
    t = (row // Hq) % T
    h = row % Hq
    tl.store(out_ptr + b * stride_ob + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


MAX_TILE = 2048  # BLOCK_M x BLOCK_N elements per program: larger [M, N] tiles spill registers
NUM_WARPS = 4  # per split program


def _tile_sizes(T: int, group: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D): powers of two >= 16 (tl.dot's smallest tile), with the score
    tile at most :data:`MAX_TILE` elements."""
    block_m = max(16, min(64, triton.next_power_of_2(T * group)))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = max(16, min(64 if block_d <= 128 else 32, MAX_TILE // block_m))
    return block_m, block_n, block_d


def default_num_splits(programs: int, num_keys: int, block_n: int, device: torch.device) -> int:
    """Splits of the key slots when the caller gives none, from shapes alone: enough programs to
    fill the GPU twice over, at least two key tiles per split, at most 64 splits (1 on the CPU)."""
    tiles = triton.cdiv(num_keys, block_n)
    want = triton.cdiv(2 * _multiprocessors(device), programs)
    return max(1, min(want, triton.cdiv(tiles, 2), 64))


def paged_span_attention_triton(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slot_pos: torch.Tensor,
    table: torch.Tensor,
    base: torch.Tensor,
    q_positions: torch.Tensor,
    r: torch.Tensor,
    rel_table: torch.Tensor,
    *,
    block_size: int,
    window: int | None,
    tau: torch.Tensor | None,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged span attention (see the module docstring) -> [B, T, Hq, D] in q's dtype.
    ``num_splits``: programs the key slots of each row are split over (None: from the shapes)."""
    _check(q, k_pool, v_pool, table, base, q_positions, r, rel_table, tau)
    if num_splits is not None and num_splits < 1:
        raise ConfigError(f"paged_span_attention: num_splits must be >= 1 or None, got {num_splits}.")
    B, T, Hq, D = q.shape
    Hkv, W, E = k_pool.shape[1], table.shape[1], rel_table.shape[1]
    group = Hq // Hkv
    num_keys = W * block_size
    block_m, block_n, block_d = _tile_sizes(T, group, D)
    m_blocks = triton.cdiv(T * group, block_m)
    programs = B * Hkv * m_blocks
    splits = num_splits or default_num_splits(programs, num_keys, block_n, q.device)
    keys_per_split = triton.cdiv(triton.cdiv(num_keys, splits), block_n) * block_n

    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    if splits == 1:
        part_max = part_sum = part_acc = out  # unused
    else:
        part_max = torch.empty(B, T, Hq, splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(B, T, Hq, splits, D, dtype=torch.float32, device=q.device)
    profile = torch.matmul(r.float(), rel_table.float())  # [B, T, Hq, E]: bias at each distance < E
    tau_arg = tau if tau is not None else q_positions  # unused without tau
    tau_strides = tau.stride() if tau is not None else (0, 0)

    split_kernel: Any = _span_attention_split_kernel  # launched with constexpr keywords pyright cannot type
    split_kernel[(programs, splits)](
        q,
        k_pool,
        v_pool,
        slot_pos,
        table,
        base,
        q_positions,
        profile,
        tau_arg,
        out,
        part_max,
        part_sum,
        part_acc,
        T,
        Hq,
        Hkv,
        group,
        num_keys,
        D,
        E,
        window if window is not None else 0,
        scale,
        keys_per_split,
        splits,
        m_blocks,
        *q.stride(),
        *k_pool.stride(),
        *v_pool.stride(),
        *table.stride(),
        *q_positions.stride(),
        *profile.stride()[:3],
        *tau_strides,
        *out.stride()[:3],
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        HAS_TAU=tau is not None,
        HAS_WINDOW=window is not None,
        DIRECT=splits == 1,
        PRECISION="ieee" if k_pool.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
    )
    if splits > 1:
        combine_kernel: Any = _combine_splits_kernel
        combine_kernel[(B * T * Hq,)](
            part_max,
            part_sum,
            part_acc,
            out,
            T,
            Hq,
            D,
            splits,
            *out.stride()[:3],
            BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_D=block_d,
        )
    return out
