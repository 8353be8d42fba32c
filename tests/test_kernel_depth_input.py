"""The fused MTP depth input (docs/design.md §1): the torch reference against the model's own
modules (``MtpDepth``'s norms over ``InklingLM.mtp_embed``), and the Triton kernel (interpreter,
fp32) against the reference."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from helpers.models import randomize_, tiny_config
from inkfw.kernels.depth_input import mtp_depth_input_reference, mtp_depth_input_triton, rms_norm
from inkfw.models.inkling.layers import RMSNorm
from inkfw.models.inkling.model import InklingLM
from inkfw.models.inkling.mtp import MtpDepth

pytestmark = pytest.mark.kernel


def depth_input_args(model: InklingLM, depth: int, token_ids: torch.Tensor, hidden: torch.Tensor):
    """The kernel's arguments for depth ``depth`` of ``model``, as the model passes them."""
    backbone = model.backbone
    assert model.mtp is not None
    own = cast(MtpDepth, model.mtp.depths[depth])
    backbone_norm = backbone.embed_norm if model.embed_source == "backbone_norm" else None
    return (
        token_ids,
        backbone.embed.weight,
        backbone_norm.weight if backbone_norm is not None else None,
        hidden,
        own.hidden_norm.weight,
        own.embed_norm.weight,
    )


def build(hidden_size: int, embed_source: str, use_embed_norm: bool = True) -> InklingLM:
    cfg = tiny_config(hidden_size=hidden_size, use_embed_norm=use_embed_norm)
    torch.manual_seed(0)
    return randomize_(InklingLM(cfg, mtp_depths=3, embed_source=embed_source)).eval()  # type: ignore[arg-type]


def test_rms_norm_function_is_the_module():
    norm = RMSNorm(24, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=torch.Generator().manual_seed(0)) * 0.2 + 1)
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(1)) * 4
    torch.testing.assert_close(rms_norm(x, norm.weight, norm.eps), norm(x), rtol=0, atol=0)
    x16, w16 = x.to(torch.bfloat16), norm.to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(x16, w16.weight, w16.eps), w16(x16), rtol=0, atol=0)


@pytest.mark.parametrize(
    "hidden_size, embed_source, use_embed_norm",
    [(32, "backbone_norm", True), (40, "backbone_norm", True), (40, "raw", True), (24, "backbone_norm", False)],
)
def test_reference_matches_model(hidden_size, embed_source, use_embed_norm, model):
    """``cat[hidden_norm(h), embed_norm(mtp_embed(ids))]`` of every depth; H = 32 is the shared
    fixture model, the others are tiny models with H not a power of two."""
    lm = model if hidden_size == 32 else build(hidden_size, embed_source, use_embed_norm)
    gen = torch.Generator().manual_seed(hidden_size)
    token_ids = torch.randint(0, lm.cfg.vocab_size, (3, 7), generator=gen)  # [B, T]
    hidden = torch.randn(3, 7, hidden_size, generator=gen) * 3  # [B, T, H]
    with torch.no_grad():
        assert lm.mtp is not None
        for d in range(len(lm.mtp)):
            own = cast(MtpDepth, lm.mtp.depths[d])
            want = torch.cat([own.hidden_norm(hidden), own.embed_norm(lm.mtp_embed(token_ids))], -1)
            got = mtp_depth_input_reference(*depth_input_args(lm, d, token_ids, hidden), eps=lm.cfg.rms_norm_eps)
            assert got.shape == (3, 7, 2 * hidden_size) and got.dtype == hidden.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "hidden_size, embed_source, use_embed_norm",
    [(32, "backbone_norm", True), (40, "backbone_norm", True), (40, "raw", True), (24, "backbone_norm", False)],
)
def test_triton_matches_reference(hidden_size, embed_source, use_embed_norm):
    """Spans of several widths (T = 1 as in decode steps, the re-prefill widths) with token ids
    read through a strided window of a wider buffer, as ``ext[:, s : s + T]``."""
    lm = build(hidden_size, embed_source, use_embed_norm)
    gen = torch.Generator().manual_seed(hidden_size + 1)
    eps = lm.cfg.rms_norm_eps
    for d, (B, T) in enumerate([(1, 1), (3, 5), (4, 3)]):
        ext = torch.randint(0, lm.cfg.vocab_size, (B, T + 4), generator=gen)  # [B, E]
        ext[-1] = 0  # a padding row
        token_ids = ext[:, d : d + T]  # [B, T], not contiguous
        hidden = torch.randn(B, T, hidden_size, generator=gen) * 3  # [B, T, H]
        args = depth_input_args(lm, d, token_ids, hidden)
        want = mtp_depth_input_reference(*args, eps=eps)
        got = mtp_depth_input_triton(*args, eps=eps)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_triton_strided_hidden():
    """Hidden states gathered as a strided view (one position of every row) are read through
    their strides."""
    lm = build(40, "backbone_norm")
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 6, 40, generator=gen)  # [B, T, H]
    hidden = wide[:, 2::3]  # [B, 2, H]
    token_ids = torch.randint(0, lm.cfg.vocab_size, (4, 2), generator=gen)
    args = depth_input_args(lm, 1, token_ids, hidden)
    torch.testing.assert_close(
        mtp_depth_input_triton(*args, eps=1e-5), mtp_depth_input_reference(*args, eps=1e-5), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
def test_triton_half_rounding(weight_dtype):
    """fp16 activations (exact in the interpreter, unlike bf16): the kernel rounds each norm's
    product to fp16 exactly where torch's ``weight * normed`` does (fp16 weights) and keeps it in
    fp32 where torch promotes (fp32 weights). Skipping or adding a rounding changes ~1/5 of the
    outputs by an ulp; fp32 rsqrt differences may move a rare one."""
    gen = torch.Generator().manual_seed(2)
    H = 40

    def weight() -> torch.Tensor:
        return (torch.randn(H, generator=gen) * 0.2 + 1).to(weight_dtype)

    embed = torch.randn(50, H, generator=gen).half()  # [V, H]
    backbone_w, hidden_w, embed_w = weight(), weight(), weight()
    token_ids = torch.randint(0, 50, (3, 5), generator=gen)  # [B, T]
    hidden = (torch.randn(3, 5, H, generator=gen) * 3).half()  # [B, T, H]
    for backbone in (backbone_w, None):
        args = (token_ids, embed, backbone, hidden, hidden_w, embed_w)
        want = mtp_depth_input_reference(*args, eps=1e-6)
        got = mtp_depth_input_triton(*args, eps=1e-6)
        assert got.dtype == want.dtype == torch.float16
        assert (got != want).sum() <= want.numel() // 100
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
