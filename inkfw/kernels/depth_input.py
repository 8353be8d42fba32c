"""The fused MTP depth input (docs/design.md §1).

Depth d's input projection reads, at every position, the hidden state it is given and the
embedding of the token it is shown, each through its own RMSNorm::

    e = embed_weight[token_ids]                            # [B, T, H]
    e = rms_norm(e, backbone_norm_weight)                  # only with embed_source=backbone_norm
    z = cat([rms_norm(hidden, hidden_norm_weight),         # hidden first
             rms_norm(e, embed_norm_weight)], dim=-1)      # [B, T, 2H], hidden's dtype

``rms_norm`` is ``inkfw.models.inkling.layers.RMSNorm``: the normalisation in fp32, rounded to
the input's dtype, then multiplied by the weight (for fp32 input and weight: ``F.rms_norm``).

Shapes: token_ids [B, T] int64, embed_weight [V, H], backbone_norm_weight [H] or None, hidden
[B, T, H], hidden_norm_weight / embed_norm_weight [H] -> z [B, T, 2H].
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``layers.RMSNorm`` as a function: x [..., H], weight [H]."""
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def mtp_depth_input_reference(
    token_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    backbone_norm_weight: torch.Tensor | None,
    hidden: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    embed_norm_weight: torch.Tensor,
    *,
    eps: float,
) -> torch.Tensor:
    """Plain torch: the embedding lookup, the norms and the concatenation (module docstring)."""
    e = F.embedding(token_ids, embed_weight)  # [B, T, H]
    if backbone_norm_weight is not None:
        e = rms_norm(e, backbone_norm_weight, eps)
    z = torch.cat([rms_norm(hidden, hidden_norm_weight, eps), rms_norm(e, embed_norm_weight, eps)], dim=-1)
    return z.to(hidden.dtype)  # [B, T, 2H]


@triton.jit
def _rms_norm_row(x, w_ptr, cols, mask, H, eps, ROUND_PRODUCT: tl.constexpr):
    """One row as ``layers.RMSNorm``: x [BLOCK_H] (zero past H) -> fp32 values of the result,
    rounded to x's dtype where torch's product ``weight * normed`` stays in it."""
    xf = x.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # F.rms_norm(x.float()).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = normed * w
    if ROUND_PRODUCT:
        out = out.to(x.dtype).to(tl.float32)
    return out


@triton.jit
def _depth_input_kernel(
    ids_ptr,  # [B, T]
    embed_ptr,  # [V, H]
    backbone_w_ptr,  # [H] (unread without the backbone norm)
    hidden_ptr,  # [B, T, H]
    hidden_w_ptr,  # [H]
    embed_w_ptr,  # [H]
    z_ptr,  # [B, T, 2H] contiguous
    T,
    H,
    eps,
    ids_stride_b,
    ids_stride_t,
    embed_stride_v,
    embed_stride_h,
    hidden_stride_b,
    hidden_stride_t,
    hidden_stride_h,
    HAS_BACKBONE_NORM: tl.constexpr,
    ROUND_BACKBONE: tl.constexpr,  # torch's products stay in the 16-bit input dtype (weights of that dtype)
    ROUND_EMBED: tl.constexpr,
    ROUND_HIDDEN: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # one program per (b, t): the whole row of H channels in one block
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    embed_dtype = embed_ptr.dtype.element_ty

    token = tl.load(ids_ptr + b * ids_stride_b + t * ids_stride_t).to(tl.int64)
    e = tl.load(embed_ptr + token * embed_stride_v + cols * embed_stride_h, mask=mask, other=0.0)
    if HAS_BACKBONE_NORM:
        e = _rms_norm_row(e, backbone_w_ptr, cols, mask, H, eps, ROUND_BACKBONE)
        if ROUND_BACKBONE:
            e = e.to(embed_dtype)
    e_out = _rms_norm_row(e, embed_w_ptr, cols, mask, H, eps, ROUND_EMBED)

    h = tl.load(hidden_ptr + b * hidden_stride_b + t * hidden_stride_t + cols * hidden_stride_h, mask=mask, other=0.0)
    h_out = _rms_norm_row(h, hidden_w_ptr, cols, mask, H, eps, ROUND_HIDDEN)

    z_row = z_ptr + row * 2 * H
    tl.store(z_row + cols, h_out.to(z_ptr.dtype.element_ty), mask=mask)
    tl.store(z_row + H + cols, e_out.to(z_ptr.dtype.element_ty), mask=mask)


def _product_rounds(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
    """Whether torch's ``weight * normed.to(x_dtype)`` rounds to a 16-bit dtype (equal 16-bit
    dtypes) rather than staying in fp32."""
    return torch.promote_types(x_dtype, weight_dtype) != torch.float32


def mtp_depth_input_triton(
    token_ids: torch.Tensor,
    embed_weight: torch.Tensor,
    backbone_norm_weight: torch.Tensor | None,
    hidden: torch.Tensor,
    hidden_norm_weight: torch.Tensor,
    embed_norm_weight: torch.Tensor,
    *,
    eps: float,
) -> torch.Tensor:
    """One launch, one program per position: same result as :func:`mtp_depth_input_reference`."""
    B, T, H = hidden.shape
    z = torch.empty(B, T, 2 * H, dtype=hidden.dtype, device=hidden.device)  # [B, T, 2H]
    if B * T == 0:
        return z
    has_backbone = backbone_norm_weight is not None
    round_backbone = has_backbone and _product_rounds(embed_weight.dtype, backbone_norm_weight.dtype)
    # the depth's embed norm sees the backbone norm's output dtype: the embedding's where the product rounds
    embed_dtype = embed_weight.dtype if not has_backbone or round_backbone else torch.float32
    block_h = triton.next_power_of_2(H)
    # triton's typing sees tl.constexpr parameters and no launch options: launch untyped
    cast(Any, _depth_input_kernel)[(B * T,)](
        token_ids,
        embed_weight,
        backbone_norm_weight if has_backbone else embed_norm_weight,
        hidden,
        hidden_norm_weight,
        embed_norm_weight,
        z,
        T,
        H,
        eps,
        *token_ids.stride(),
        *embed_weight.stride(),
        *hidden.stride(),
        HAS_BACKBONE_NORM=has_backbone,
        ROUND_BACKBONE=round_backbone,
        ROUND_EMBED=_product_rounds(embed_dtype, embed_norm_weight.dtype),
        ROUND_HIDDEN=_product_rounds(hidden.dtype, hidden_norm_weight.dtype),
        BLOCK_H=block_h,
        num_warps=max(1, min(16, block_h // 256)),
    )
    return z
