"""Cached short convolution: write each token's conv input to its slot of the paged conv pool, read
the K-1 previous inputs back by position, convolve depthwise and add the residual, in one launch.

For S streams of one layer that share the channel count C (S = 1, or 2 for the k and v streams of
an attention layer), tokens ``x [S, B, T, C]`` at ``positions [B, T]``:

1. ``x[s, b, t]`` is written to ``store[s][slot(b, p)]`` for every ``valid`` token whose position
   ``p`` has a slot (``slot = table[b, p // bs - base[b]] * bs + p % bs``, the column inside
   ``[0, W)`` and the entry >= 0); padding and unmapped tokens write nothing (the reference
   rewrites the pool's last slot with its own value: that slot, in PagedKVManager's scratch
   block, must be in no table);
2. ``y[s, b, t] = x[s, b, t] + sum_j weight[s, :, j] * in(p - (K-1) + j)``, where ``in(q)`` is
   the input stored for position ``q``: zero unless ``q >= 0``, ``q`` has a slot and
   ``slot_pos[slot] == q`` (stale, never-written and invalidated slots read as zero). Inputs
   written by step 1 are seen (write, then read), including the token's own input at ``j = K-1``;
3. the arithmetic is fp32; ``y [S, B, T, C]`` has x's dtype.

This is ``ShortConv.forward`` (``inkfw/models/inkling/layers.py``) over
``PagedLayerCache.conv_window`` (``inkfw/cache/paged.py``): conv state is cache state, indexed by
position like KV (docs/design.md §4). As there, the slot tags ``slot_pos`` of this step's tokens
are set before the layer runs (``StepView``); this op writes only the data. Valid tokens of one
row must hold distinct positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from inkfw.errors import ConfigError


def _slots(
    table: torch.Tensor, base: torch.Tensor, positions: torch.Tensor, usable: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot [B, ...] of ``positions`` [B, ...] through ``table`` [B, W] from logical block ``base``
    [B], 0 where there is none; mapped [B, ...]: ``usable`` and the position has a slot)."""
    B, W = table.shape
    column = positions.div(block_size, rounding_mode="floor") - base.view(-1, *([1] * (positions.dim() - 1)))
    inside = (column >= 0) & (column < W)
    phys = table.gather(1, column.clamp(0, W - 1).reshape(B, -1)).view(column.shape)
    mapped = usable & inside & (phys >= 0)
    return torch.where(mapped, phys * block_size + positions.remainder(block_size), 0), mapped


def _check(
    x: torch.Tensor, weight: torch.Tensor, store: Sequence[torch.Tensor], table: torch.Tensor, positions: torch.Tensor
) -> None:
    S, B, T, C = x.shape
    if S not in (1, 2) or len(store) != S:
        raise ConfigError(f"cached_short_conv takes 1 or 2 streams with one store each, got {S} and {len(store)}.")
    if weight.dim() != 3 or tuple(weight.shape[:2]) != (S, C):
        raise ConfigError(f"cached_short_conv: weight must be [S={S}, C={C}, K], got {tuple(weight.shape)}.")
    first = store[0]
    for s in store:
        if s.dim() != 2 or s.shape != first.shape or s.shape[1] != C or s.dtype != first.dtype:
            raise ConfigError(f"cached_short_conv: every store must be [num_slots, C={C}] of one dtype.")
    if tuple(positions.shape) != (B, T) or table.shape[0] != B:
        raise ConfigError(f"cached_short_conv: positions must be [B={B}, T={T}] and table [B={B}, W].")


def cached_short_conv_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    store: Sequence[torch.Tensor],
    slot_pos: torch.Tensor,
    table: torch.Tensor,
    base: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *,
    block_size: int,
) -> torch.Tensor:
    """x [S, B, T, C], weight [S, C, K], store S x [num_slots, C] (written in place), slot_pos
    [num_slots], table [B, W], base [B], positions [B, T], valid [B, T] -> y [S, B, T, C]."""
    _check(x, weight, store, table, positions)
    S, B, T, C = x.shape
    K = weight.shape[-1]
    write_slot, write_ok = _slots(table, base, positions, valid, block_size)  # [B, T] x2
    # unmapped tokens and padding "write" the last slot (the pool's scratch block: in no table) with
    # what it holds, so nothing changes
    write_slot = torch.where(write_ok, write_slot, store[0].shape[0] - 1).reshape(-1)  # [B*T]
    write_ok = write_ok.reshape(-1, 1)  # [B*T, 1]
    want = positions[:, :, None] + torch.arange(-(K - 1), 1, device=positions.device)  # [B, T, K]
    read_slot, read_ok = _slots(table, base, want.clamp(min=0), want >= 0, block_size)  # [B, T, K] x2
    read_ok = read_ok & (slot_pos[read_slot] == want)
    ys = []
    for s in range(S):
        pool = store[s]
        kept = pool.index_select(0, write_slot)  # [B*T, C]
        pool.index_copy_(0, write_slot, torch.where(write_ok, x[s].reshape(-1, C).to(pool.dtype), kept))
        window = pool.index_select(0, read_slot.reshape(-1)).view(B, T, K, C).float()  # [B, T, K, C]
        window = window.masked_fill(~read_ok[..., None], 0.0)
        conv = (window * weight[s].float().t()).sum(2)  # [B, T, K, C] * [K, C], summed over K
        ys.append((x[s].float() + conv).to(x.dtype))
    return torch.stack(ys)  # [S, B, T, C]


@triton.jit
def _window_input(
    x_ptr,
    store_ptr,
    slot,
    src_t,
    from_x,
    from_store,
    channels,
    channel_mask,
    stride_xt,
    stride_xc,
    stride_row,
):
    """fp32 input of one window position for BLOCK_C channels: the span's own token ``src_t`` (as
    the store would hold it) when ``from_x``, the pool's ``slot`` when ``from_store``, else 0.
    (A scalar condition joins a channel mask through ``tl.where``: Triton's interpreter cannot
    ``&`` a loaded scalar with a block.)"""
    held = tl.load(
        x_ptr + src_t * stride_xt + channels * stride_xc, mask=tl.where(from_x, channel_mask, False), other=0.0
    )
    held = held.to(store_ptr.dtype.element_ty).to(tl.float32)
    stored = tl.load(
        store_ptr + slot * stride_row + channels, mask=tl.where(from_store, channel_mask, False), other=0.0
    )
    return held + stored.to(tl.float32)


@triton.jit
def _cached_short_conv_kernel(
    x_ptr,  # [S, B, T, C]
    w_ptr,  # [S, C, K]
    store0_ptr,  # [num_slots, C] stream 0
    store1_ptr,  # [num_slots, C] stream 1 (== store0_ptr when S == 1)
    slot_pos_ptr,  # [num_slots]
    table_ptr,  # [B, W]
    base_ptr,  # [B]
    pos_ptr,  # [B, T]
    valid_ptr,  # [B, T] uint8
    y_ptr,  # [S, B, T, C] contiguous
    T,
    C,
    W,
    num_slots,
    stride_xs,
    stride_xb,
    stride_xt,
    stride_xc,
    stride_ws,
    stride_wc,
    stride_wk,
    stride_row0,
    stride_row1,
    stride_table_b,
    stride_table_w,
    stride_pos_b,
    stride_pos_t,
    stride_valid_b,
    stride_valid_t,
    S: tl.constexpr,
    K: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # one program: token (b, t), BLOCK_C channels, every stream (they share the slot arithmetic)
    token = tl.program_id(0)
    b = token // T
    t = token % T
    channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channels < C

    p = tl.load(pos_ptr + b * stride_pos_b + t * stride_pos_t)
    valid = tl.load(valid_ptr + b * stride_valid_b + t * stride_valid_t) != 0
    first_block = tl.load(base_ptr + b)
    # the row's own tokens: an earlier position of this span is read from x (another program's
    # write to the pool is not visible inside one launch)
    span = tl.arange(0, BLOCK_T)
    span_mask = span < T
    span_pos = tl.load(pos_ptr + b * stride_pos_b + span * stride_pos_t, mask=span_mask, other=-1)
    span_valid = tl.load(valid_ptr + b * stride_valid_b + span * stride_valid_t, mask=span_mask, other=0) != 0
    span_ok = span_mask & span_valid

    x0_ptr = x_ptr + b * stride_xb
    x1_ptr = x0_ptr + stride_xs
    # the token's own slot (its window's last position), written below by valid tokens only
    own_column = tl.maximum(p, 0) // BLOCK_SIZE - first_block
    own_inside = valid & (p >= 0) & (own_column >= 0) & (own_column < W)
    own_column = tl.minimum(tl.maximum(own_column, 0), W - 1)
    own_phys = tl.load(table_ptr + b * stride_table_b + own_column * stride_table_w, mask=own_inside, other=-1)
    write = tl.where(own_inside & (own_phys >= 0), channel_mask, False)  # [BLOCK_C]
    own_slot = tl.where(own_phys >= 0, own_phys * BLOCK_SIZE + tl.maximum(p, 0) % BLOCK_SIZE, 0)
    own_slot = tl.minimum(own_slot, num_slots - 1)

    acc0 = tl.zeros([BLOCK_C], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # pyright: ignore[reportGeneralTypeIssues]  (unrolled; the stubs type it badly)
        q = p - (K - 1) + j
        q_safe = tl.maximum(q, 0)
        column = q_safe // BLOCK_SIZE - first_block
        inside = (q >= 0) & (column >= 0) & (column < W)
        column = tl.minimum(tl.maximum(column, 0), W - 1)
        phys = tl.load(table_ptr + b * stride_table_b + column * stride_table_w, mask=inside, other=-1)
        mapped = inside & (phys >= 0)
        slot = tl.where(mapped, phys * BLOCK_SIZE + q_safe % BLOCK_SIZE, 0)
        slot = tl.minimum(slot, num_slots - 1)
        tag = tl.load(slot_pos_ptr + slot, mask=mapped, other=-1)
        readable = mapped & (tag == q)
        src_t: tl.tensor = tl.max(tl.where(span_ok & (span_pos == q), span, -1), axis=0)  # type: ignore[assignment]
        from_x = readable & (src_t >= 0)
        from_store = readable & (src_t < 0)
        src_t = tl.maximum(src_t, 0)
        w0 = tl.load(w_ptr + channels * stride_wc + j * stride_wk, mask=channel_mask, other=0.0).to(tl.float32)
        acc0 += w0 * _window_input(
            x0_ptr,
            store0_ptr,
            slot,
            src_t,
            from_x,
            from_store,
            channels,
            channel_mask,
            stride_xt,
            stride_xc,
            stride_row0,
        )
        if S == 2:
            w1 = tl.load(w_ptr + stride_ws + channels * stride_wc + j * stride_wk, mask=channel_mask, other=0.0).to(
                tl.float32
            )
            acc1 += w1 * _window_input(
                x1_ptr,
                store1_ptr,
                slot,
                src_t,
                from_x,
                from_store,
                channels,
                channel_mask,
                stride_xt,
                stride_xc,
                stride_row1,
            )

    y_offsets = (b * T + t) * C + channels
    x0 = tl.load(x0_ptr + t * stride_xt + channels * stride_xc, mask=channel_mask, other=0.0)
    tl.store(store0_ptr + own_slot * stride_row0 + channels, x0.to(store0_ptr.dtype.element_ty), mask=write)
    tl.store(y_ptr + y_offsets, (x0.to(tl.float32) + acc0).to(y_ptr.dtype.element_ty), mask=channel_mask)
    if S == 2:
        x1 = tl.load(x1_ptr + t * stride_xt + channels * stride_xc, mask=channel_mask, other=0.0)
        tl.store(store1_ptr + own_slot * stride_row1 + channels, x1.to(store1_ptr.dtype.element_ty), mask=write)
        y1_offsets = y_offsets + tl.num_programs(0) * C
        tl.store(y_ptr + y1_offsets, (x1.to(tl.float32) + acc1).to(y_ptr.dtype.element_ty), mask=channel_mask)


def cached_short_conv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    store: Sequence[torch.Tensor],
    slot_pos: torch.Tensor,
    table: torch.Tensor,
    base: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    *,
    block_size: int,
) -> torch.Tensor:
    """Same as :func:`cached_short_conv_reference` in one launch: a program per token and block of
    up to 1024 channels does every stream (the S <= 2 stores, separate tensors, come in as two
    pointer arguments and a constexpr S), so the slot arithmetic is shared. The grid depends only
    on shapes and nothing is read back to the host (CUDA-graph friendly). Earlier positions of a
    row's own span are read from ``x``: another program's pool write is not visible in-launch."""
    _check(x, weight, store, table, positions)
    S, B, T, C = x.shape
    K = weight.shape[-1]
    num_slots = store[0].shape[0]
    y = torch.empty((S, B, T, C), dtype=x.dtype, device=x.device)
    if B * T == 0 or C == 0:
        return y
    store0 = store[0]
    store1 = store[1] if S == 2 else store0
    for pool in (store0, store1):
        if pool.stride(1) != 1:
            raise ConfigError("cached_short_conv: the conv stores' channels must be contiguous.")
    valid_bytes = valid.to(torch.bool).view(torch.uint8)
    BLOCK_C = min(triton.next_power_of_2(C), 1024)
    grid = (B * T, triton.cdiv(C, BLOCK_C))
    kernel: Any = _cached_short_conv_kernel  # launched with constexpr keywords pyright cannot type
    kernel[grid](
        x,
        weight,
        store0,
        store1,
        slot_pos,
        table,
        base,
        positions,
        valid_bytes,
        y,
        T,
        C,
        table.shape[1],
        num_slots,
        *x.stride(),
        *weight.stride(),
        store0.stride(0),
        store1.stride(0),
        *table.stride(),
        *positions.stride(),
        *valid_bytes.stride(),
        S=S,
        K=K,
        BLOCK_SIZE=block_size,
        BLOCK_T=triton.next_power_of_2(T),
        BLOCK_C=BLOCK_C,
        num_warps=4 if BLOCK_C >= 512 else 2 if BLOCK_C >= 128 else 1,
    )
    return y
