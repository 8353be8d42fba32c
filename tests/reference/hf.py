"""Hugging Face transformers (5.23) reference models for parity tests.

Builds HF Inkling configs equivalent to an inkfw :class:`~inkfw.models.inkling.config.InklingConfig`,
randomises HF models with weights large enough that every component moves the logits, and
writes them with ``save_pretrained`` (HF names for ``InklingForCausalLM``, the release layout
for ``InklingForConditionalGeneration``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from inkfw.models.inkling.config import InklingConfig

# tiny multimodal towers: HF builds them for InklingForConditionalGeneration, inkfw skips them
TINY_VISION = dict(
    hidden_size=16, num_hidden_layers=2, num_attention_heads=2, patch_size=4, temporal_patch_size=2, num_channels=3
)
TINY_AUDIO = dict(n_mel_bins=4, mel_vocab_size=8)


def hf_text_dict(cfg: InklingConfig, with_mtp: bool = True) -> dict[str, Any]:
    """``InklingTextConfig`` kwargs for ``cfg`` (MTP fields inline, as HF names them)."""
    assert cfg.use_embed_norm, "HF Inkling always applies the embedding norm"
    d = cfg.to_text_dict()
    d.pop("model_type")
    if with_mtp and cfg.mtp.num_nextn_predict_layers > 0:
        d["num_mtp_layers"] = cfg.mtp.num_nextn_predict_layers
        d["chain_hidden_post_norm"] = cfg.mtp.chain_hidden_post_norm
        d["mtp_local_layer_ids"] = list(cfg.mtp.local_layer_ids)
    return d


def hf_text_config(cfg: InklingConfig, with_mtp: bool = True, attn_implementation: str | None = None):
    from transformers import InklingTextConfig

    hc = InklingTextConfig(**hf_text_dict(cfg, with_mtp))
    if attn_implementation is not None:
        hc._attn_implementation = attn_implementation
    return hc


def hf_mm_dict(cfg: InklingConfig) -> dict[str, Any]:
    """``InklingConfig`` (``inkling_mm_model``) kwargs: text_config, tiny towers, top-level mtp_config."""
    return dict(
        text_config=hf_text_dict(cfg, with_mtp=False),
        vision_config=dict(TINY_VISION),
        audio_config=dict(TINY_AUDIO),
        mtp_config=dict(
            num_nextn_predict_layers=cfg.mtp.num_nextn_predict_layers,
            chain_hidden_post_norm=cfg.mtp.chain_hidden_post_norm,
            local_layer_ids=list(cfg.mtp.local_layer_ids),
        ),
    )


def hf_mm_config(cfg: InklingConfig, attn_implementation: str | None = None):
    from transformers import InklingConfig as HFInklingConfig

    hc = HFInklingConfig(**hf_mm_dict(cfg))
    if attn_implementation is not None:
        hc._attn_implementation = attn_implementation
    return hc


@torch.no_grad()
def randomize_hf_(
    module: nn.Module, seed: int = 0, lm_head: nn.Linear | None = None, mup: float | None = None
) -> nn.Module:
    """Sizeable random weights for every HF Inkling parameter and persistent buffer.

    Norm weights ~ 1 +- 0.2, short convs std 0.4, relative-bias banks std 0.5, router weight
    std 0.5 with global scale ~ 1 +- 0.2 and a nonzero score-correction bias, MLP global scales
    ~ 1 +- 0.2, every matrix std 1/sqrt(fan_in), embeddings std 1. ``lm_head`` (if given) is
    then scaled by ``3 * mup`` so logits are O(1..10) after the muP division.
    """
    from transformers.models.inkling import modeling_inkling as mi

    g = torch.Generator().manual_seed(seed)
    touched: set[int] = set()

    def rnd(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * std + mean)
        touched.add(id(p))

    for m in module.modules():
        if isinstance(m, mi.InklingRMSNorm):
            rnd(m.weight, 0.2, 1.0)
        elif isinstance(m, mi.InklingShortConvolution):
            rnd(m.conv1d.weight, 0.4)
        elif isinstance(m, mi.InklingRelativeLogits):
            rnd(m.proj, 0.5)
        elif isinstance(m, mi.InklingMLP):
            rnd(m.global_scale, 0.2, 1.0)  # its Linears are handled below
        elif isinstance(m, mi.InklingExperts):
            rnd(m.gate_up_proj, m.gate_up_proj.shape[-1] ** -0.5)
            rnd(m.down_proj, m.down_proj.shape[-1] ** -0.5)
        elif isinstance(m, mi.InklingTopkRouter):
            rnd(m.weight, 0.5)
            rnd(m.global_scale, 0.2, 1.0)
            rnd(m.e_score_correction_bias, 0.1)
        elif isinstance(m, mi.InklingSharedExperts):
            for p in (m.gate_proj, m.up_proj, m.down_proj):
                rnd(p, p.shape[-1] ** -0.5)
        elif isinstance(m, nn.Embedding):
            rnd(m.weight, 1.0)
        elif isinstance(m, nn.Linear):
            rnd(m.weight, m.weight.shape[1] ** -0.5)
            if m.bias is not None:
                rnd(m.bias, 0.1)
    # every parameter and persistent buffer must have been drawn: an HF init value left in place
    # (ones, zeros) would hide a wrong mapping of that tensor
    persistent = dict(module.named_parameters())
    persistent.update({n: b for n, b in module.named_buffers() if n in module.state_dict()})
    missed = sorted(n for n, t in persistent.items() if id(t) not in touched)
    assert not missed, f"randomize_hf_ left tensors untouched: {missed}"
    if lm_head is not None:
        assert mup is not None
        lm_head.weight.mul_(3.0 * mup)
    return module


def randomize_hf_lm_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Randomise an ``InklingForCausalLM`` or ``InklingForConditionalGeneration``."""
    text = model.config.get_text_config()
    return randomize_hf_(model, seed, lm_head=model.lm_head, mup=text.logits_mup_width_multiplier)


def build_hf_causal_lm(
    cfg: InklingConfig, seed: int = 0, with_mtp: bool = False, attn_implementation: str | None = None
):
    """A randomised HF ``InklingForCausalLM`` (fp32, eval) equivalent to ``cfg``."""
    from transformers import InklingForCausalLM

    torch.manual_seed(seed)
    model = InklingForCausalLM(hf_text_config(cfg, with_mtp, attn_implementation))
    return randomize_hf_lm_(model, seed).float().eval()


def build_hf_mm_model(cfg: InklingConfig, seed: int = 0, attn_implementation: str | None = None):
    """A randomised HF ``InklingForConditionalGeneration`` (fp32, eval) with tiny vision/audio towers."""
    from transformers import InklingForConditionalGeneration

    torch.manual_seed(seed)
    model = InklingForConditionalGeneration(hf_mm_config(cfg, attn_implementation))
    return randomize_hf_lm_(model, seed).float().eval()


def build_hf_mtp(main_model, seed: int = 1):
    """HF ``MtpModel`` on top of ``main_model`` (already randomised), its own layers randomised.

    ``MtpModel`` copies the main model's embedding (dropping its norm) at construction, so the
    copy is re-taken after randomising to be sure it holds the main model's weights.
    """
    from transformers.modeling_layers import MtpModel

    num = main_model.config.get_text_config().num_mtp_layers
    mtp = MtpModel(main_model, num)
    mtp.tie_with_main_model(main_model)
    randomize_hf_(mtp.layers, seed)
    if getattr(mtp, "shared_post_norm", None) is not None:
        randomize_hf_(mtp.shared_post_norm, seed + 1)
    return mtp.float().eval()


def save_hf(model, path: str | Path) -> Path:
    """``save_pretrained`` into ``path`` (safetensors) and return it."""
    path = Path(path)
    model.save_pretrained(str(path))
    return path


def hf_mtp_tensors(mtp) -> dict[str, torch.Tensor]:
    """The MTP tensors of an HF ``MtpModel`` under the checkpoint names inkfw reads in the
    ``hf`` layout: ``model.mtp.layers.{d}.{hidden_norm,embed_norm,input_proj}.weight``,
    ``model.mtp.layers.{d}.transformer_block.<HF decoder-layer names>``, ``model.mtp.chain_norm.weight``."""
    out: dict[str, torch.Tensor] = {}
    for d, layer in enumerate(mtp.layers):
        p = f"model.mtp.layers.{d}."
        for ours, theirs in (("hidden_norm", "hnorm"), ("embed_norm", "enorm"), ("input_proj", "eh_proj")):
            out[f"{p}{ours}.weight"] = getattr(layer, theirs).weight.detach().clone()
        assert {n for n, _ in layer.named_children()} == {"hnorm", "enorm", "eh_proj", "mtp_block"}
        for name, t in layer.mtp_block.state_dict().items():
            out[f"{p}transformer_block.{name}"] = t.detach().clone()
    if getattr(mtp, "shared_post_norm", None) is not None:
        out["model.mtp.chain_norm.weight"] = mtp.shared_post_norm.weight.detach().clone()
    return out
