"""Draft-span preparation for re-prefill (docs/design.md §2).

A drafting round runs every prefill depth over each request's span: the r re-prefilled
positions (whose target hidden states sit at the end of the request's tail) followed by the
positions the verify step just committed (whose hidden states arrive in ``hidden``). Per row b,
with P - 1 = ``tail.shape[1]``, r = ``takes[b]``, n = ``lengths[b]`` (= r + new positions)::

    src_b        = cat(tail[slots[b]], hidden[b])                    # [P-1 + Th, H]
    last[b]      = max(n - 1, 0)
    g[b, j]      = src_b[P-1 - r + min(j, last[b])]                  # j < width, [width, H]
    positions[b, j] = starts[b] + min(j, last[b])
    valid[b, j]  = j < n
    tail[slots[b]] <- src_b[n - r : n - r + P-1]                     # the last P-1 rows of the span

``g`` reads the tail as it was before the update. Padding rows (slot = the scratch row
``tail.shape[0] - 1``, length 0, take 0) write only the scratch row, whose content is never read.

Shapes: tail [num_slots + 1, P-1, H] (P-1 may be 0), hidden [B, Th, H], slots / starts / takes /
lengths [B] int64 -> g [B, width, H] (tail's dtype), positions [B, width] int64, valid [B, width]
bool, last [B] int64.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import triton
import triton.language as tl


def prepare_draft_spans_reference(
    tail: torch.Tensor,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    takes: torch.Tensor,
    lengths: torch.Tensor,
    *,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch: the span's rows gathered from ``cat(tail[slots], hidden)``, and the tail
    updated in place (see the module docstring)."""
    tail_rows = tail.shape[1]  # P - 1
    H = tail.shape[-1]
    columns = torch.arange(width, device=slots.device)  # [width]
    last = (lengths - 1).clamp(min=0)  # [B]
    row = torch.minimum(columns[None, :], last[:, None])  # [B, width]: span row j reads its row min(j, n - 1)
    positions = starts[:, None] + row  # [B, width]
    valid = columns[None, :] < lengths[:, None]  # [B, width]
    src = torch.cat([tail[slots], hidden.to(tail.dtype)], dim=1)  # [B, P-1 + Th, H]
    gather = tail_rows - takes[:, None] + row  # [B, width]
    g = src.gather(1, gather[:, :, None].expand(-1, -1, H))  # [B, width, H]
    if tail_rows > 0:
        keep = torch.arange(tail_rows, device=slots.device)  # [P-1]
        new_tail = (lengths - takes)[:, None] + keep[None, :]  # [B, P-1]: the span's last P-1 rows of src
        tail.index_copy_(0, slots, src.gather(1, new_tail[:, :, None].expand(-1, -1, H)))
    return g, positions, valid, last


@triton.jit
def _load_source_rows(
    tail_ptr,
    hidden_ptr,
    slot,
    b,
    rows,  # [R] int64: rows of src = cat(tail[slot], hidden[b])
    row_mask,  # [R]
    cols,  # [BLOCK_H]
    col_mask,  # [BLOCK_H]
    tail_stride_s,
    tail_stride_p,
    tail_stride_h,
    hidden_stride_b,
    hidden_stride_t,
    hidden_stride_h,
    TAIL_ROWS: tl.constexpr,
):
    """src rows ``rows`` of row b, columns ``cols``, in the tail's dtype: [R, BLOCK_H]."""
    from_tail = rows < TAIL_ROWS
    tail_rows = tl.where(from_tail, rows, 0)
    hidden_rows = tl.where(from_tail, 0, rows - TAIL_ROWS)
    tail_ptrs = tail_ptr + slot * tail_stride_s + tail_rows[:, None] * tail_stride_p + cols[None, :] * tail_stride_h
    hidden_ptrs = (
        hidden_ptr + b * hidden_stride_b + hidden_rows[:, None] * hidden_stride_t + cols[None, :] * hidden_stride_h
    )
    mask = row_mask[:, None] & col_mask[None, :]
    old = tl.load(tail_ptrs, mask=mask & from_tail[:, None], other=0.0)
    new = tl.load(hidden_ptrs, mask=mask & (rows >= TAIL_ROWS)[:, None], other=0.0)
    return tl.where(from_tail[:, None], old, new.to(old.dtype))


@triton.jit
def _draft_span_kernel(
    tail_ptr,  # [num_slots + 1, P-1, H]
    hidden_ptr,  # [B, Th, H]
    slots_ptr,  # [B]
    starts_ptr,  # [B]
    takes_ptr,  # [B]
    lengths_ptr,  # [B]
    g_ptr,  # [B, width, H] contiguous
    positions_ptr,  # [B, width] contiguous
    valid_ptr,  # [B, width] contiguous (bool)
    last_ptr,  # [B]
    H,
    width,
    tail_stride_s,
    tail_stride_p,
    tail_stride_h,
    hidden_stride_b,
    hidden_stride_t,
    hidden_stride_h,
    TAIL_ROWS: tl.constexpr,  # P - 1
    BLOCK_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_TAIL: tl.constexpr,
):
    # one program per (row b, block of H columns): it alone reads and writes tail[slot_b][:, columns]
    # (rows have distinct slots, except padding rows that all write the never-read scratch row)
    b = tl.program_id(0).to(tl.int64)
    h_block = tl.program_id(1)
    slot = tl.load(slots_ptr + b)
    start = tl.load(starts_ptr + b)
    take = tl.load(takes_ptr + b)
    length = tl.load(lengths_ptr + b)
    last = tl.maximum(length - 1, 0)

    j = tl.arange(0, BLOCK_W)  # span rows
    j_mask = j < width
    row = tl.minimum(j.to(tl.int64), last)  # [BLOCK_W]
    cols = h_block * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H

    # the span's rows, read from the old tail and the new hidden states
    g = _load_source_rows(
        tail_ptr,
        hidden_ptr,
        slot,
        b,
        TAIL_ROWS - take + row,
        j_mask,
        cols,
        col_mask,
        tail_stride_s,
        tail_stride_p,
        tail_stride_h,
        hidden_stride_b,
        hidden_stride_t,
        hidden_stride_h,
        TAIL_ROWS,
    )
    g_ptrs = g_ptr + (b * width + j[:, None]) * H + cols[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=j_mask[:, None] & col_mask[None, :])

    if h_block == 0:  # the integer outputs: written once per row
        tl.store(positions_ptr + b * width + j, start + row, mask=j_mask)
        tl.store(valid_ptr + b * width + j, (j < length).to(valid_ptr.dtype.element_ty), mask=j_mask)
        tl.store(last_ptr + b, last)

    if TAIL_ROWS > 0:
        i = tl.arange(0, BLOCK_TAIL)
        i_mask = i < TAIL_ROWS
        kept = _load_source_rows(
            tail_ptr,
            hidden_ptr,
            slot,
            b,
            length - take + i.to(tl.int64),
            i_mask,
            cols,
            col_mask,
            tail_stride_s,
            tail_stride_p,
            tail_stride_h,
            hidden_stride_b,
            hidden_stride_t,
            hidden_stride_h,
            TAIL_ROWS,
        )
        # every read of the old tail (above, by any thread of this program) precedes every write
        tl.debug_barrier()
        tail_ptrs = tail_ptr + slot * tail_stride_s + i[:, None] * tail_stride_p + cols[None, :] * tail_stride_h
        tl.store(tail_ptrs, kept, mask=i_mask[:, None] & col_mask[None, :])


def prepare_draft_spans_triton(
    tail: torch.Tensor,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    takes: torch.Tensor,
    lengths: torch.Tensor,
    *,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One launch, grid (B, H blocks): same results and tail update as
    :func:`prepare_draft_spans_reference`."""
    B, H = slots.shape[0], tail.shape[-1]
    tail_rows = tail.shape[1]
    device = tail.device
    g = torch.empty(B, width, H, dtype=tail.dtype, device=device)
    positions = torch.empty(B, width, dtype=torch.long, device=device)
    valid = torch.empty(B, width, dtype=torch.bool, device=device)
    last = torch.empty(B, dtype=torch.long, device=device)
    if B == 0:
        return g, positions, valid, last
    block_w = triton.next_power_of_2(width)
    block_h = max(16, min(triton.next_power_of_2(H), 4096 // block_w))  # a [BLOCK_W, BLOCK_H] tile per program
    grid = (B, triton.cdiv(H, block_h))
    # triton's typing sees tl.constexpr parameters and no launch options: launch untyped
    cast(Any, _draft_span_kernel)[grid](
        tail,
        hidden,
        slots.contiguous(),
        starts.contiguous(),
        takes.contiguous(),
        lengths.contiguous(),
        g,
        positions,
        valid,
        last,
        H,
        width,
        *tail.stride(),
        *hidden.stride(),
        TAIL_ROWS=tail_rows,
        BLOCK_W=block_w,
        BLOCK_H=block_h,
        BLOCK_TAIL=triton.next_power_of_2(max(tail_rows, 1)),
    )
    return g, positions, valid, last
