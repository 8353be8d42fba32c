"""Numerical parity with Hugging Face transformers 5.23 (the project's reference), fp32 on CPU.

* Backbone: HF ``InklingForCausalLM`` / ``InklingForConditionalGeneration`` saved with
  ``save_pretrained`` (HF names resp. the release layout) -> ``inkfw.models.inkling.checkpoint.load_model`` ->
  same logits, over sequences longer than the sliding window and the relative-bias extent.
* MTP: HF ``MtpModel`` (embedding source ``raw``, as HF 5.23 feeds it) -> inkfw ``mtp_chain``.
* MTP vs a plain-torch restatement of docs/design.md §1 (embedding source ``backbone_norm``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from reference.hf import (
    build_hf_causal_lm,
    build_hf_mm_model,
    build_hf_mtp,
    hf_mtp_tensors,
    save_hf,
)
from safetensors.torch import load_file, save_file

from helpers.models import tiny_config
from inkfw.models.inkling.checkpoint import load_model
from inkfw.models.inkling.config import MtpConfig
from inkfw.models.inkling.model import InklingLM

ATOL = 1e-4
B, T = 2, 40  # T > sliding_window (8) and > rel_extent (16) in every config below

# Debug configs (overrides of tests/helpers/models.py::tiny_config), each 2-4 layers.
CONFIGS = {
    # local+dense, local+MoE, global+MoE with log scaling, local+MoE; GQA in both kinds
    "mixed": dict(),
    # log scaling off; two global layers (MHA) around one local; two dense layers then MoE
    "no_log_scaling": dict(
        num_layers=3,
        local_layer_ids=[1],
        log_scaling_n_floor=None,
        num_kv_heads=4,
        swa_num_kv_heads=2,
        dense_mlp_idx=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
    ),
    # every layer local and MoE; wider local heads, kernel 3, no padded vocab
    "all_local_moe": dict(
        num_layers=2,
        local_layer_ids=[0, 1],
        dense_mlp_idx=0,
        swa_head_dim=16,
        swa_num_heads=2,
        swa_num_kv_heads=2,
        d_rel=2,
        conv_kernel_size=3,
        unpadded_vocab_size=None,
        n_routed_experts=4,
    ),
    # every layer dense; global layers with strong log scaling from position 1 on
    "all_dense_global": dict(
        num_layers=3,
        local_layer_ids=[1],
        dense_mlp_idx=3,
        log_scaling_n_floor=1,
        log_scaling_alpha=0.5,
        rel_extent=12,
        num_heads=8,
        num_kv_heads=2,
        head_dim=4,
    ),
}


def _ids(cfg, batch: int = B, length: int = T, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=g)


def _check_logits(ours: torch.Tensor, theirs: torch.Tensor, cfg) -> None:
    assert ours.shape == theirs.shape == (B, T, cfg.logits_vocab_size)
    # a zero or constant model cannot pass: logits are sizeable and vary along the sequence
    assert theirs.abs().max() > 0.5
    assert (theirs[:, 1:] - theirs[:, :-1]).abs().max() > 0.5
    diff = (ours - theirs).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| = {diff:.3g}"


# --------------------------------------------------------------------------- backbone
@pytest.mark.parametrize(("name", "attn"), [(n, "sdpa") for n in CONFIGS] + [("mixed", "eager")])
def test_causal_lm_parity(tmp_path, name, attn):
    torch.manual_seed(0)
    cfg = tiny_config(**CONFIGS[name])
    hf = build_hf_causal_lm(cfg, seed=1, attn_implementation=attn)
    path = save_hf(hf, tmp_path / "hf")

    model, ckpt = load_model(path, mtp_depths=0)
    assert ckpt.layout == "hf"
    assert model.num_mtp_depths == 0
    # config.json round trip: every backbone field equal (HF ships no MTP fields here)
    assert dataclasses.replace(ckpt.config, mtp=cfg.mtp) == cfg

    ids = _ids(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        ours = model.logits(model(ids))
    _check_logits(ours, theirs, cfg)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_conditional_generation_release_layout_parity(tmp_path, name):
    """InklingForConditionalGeneration.save_pretrained writes the release layout (model.llm.*,
    gate/up interleaved; model.visual.*, model.audio.* towers that inkfw skips)."""
    torch.manual_seed(0)
    cfg = tiny_config(**CONFIGS[name])
    hf = build_hf_mm_model(cfg, seed=2)
    path = save_hf(hf, tmp_path / "mm")

    model, ckpt = load_model(path, mtp_depths=0)
    assert ckpt.layout == "release"
    names = set(ckpt.weight_map)
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.audio.") for n in names)
    last = cfg.num_layers - 1
    if cfg.is_moe(last):
        assert f"model.llm.layers.{last}.mlp.experts.w13_weight" in names  # interleaved gate/up
        assert f"model.llm.layers.{last}.mlp.shared_experts.shared_w13_weight" in names
    if not cfg.is_moe(0):
        assert "model.llm.layers.0.mlp.w13_dn.weight" in names
    assert ckpt.config == cfg  # text_config + top-level mtp_config read back

    ids = _ids(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        ours = model.logits(model(ids))
    _check_logits(ours, theirs, cfg)


@pytest.mark.parametrize(
    "param",
    [
        "backbone.layers.0.attn.rel_bias.table",  # local layer bias
        "backbone.layers.2.attn.rel_bias.table",  # global layer bias (beyond the window)
        "backbone.layers.1.mlp.router.score_bias",  # routing choice only
        "backbone.layers.3.attn.k_sconv.weight",
        "backbone.layers.0.mlp.gate_up",  # gate/up order
    ],
)
def test_parity_check_is_sensitive(tmp_path, param):
    """The parity bound would catch a mistake in each of these tensors."""
    torch.manual_seed(0)
    cfg = tiny_config()
    hf = build_hf_causal_lm(cfg, seed=1)
    model, _ = load_model(save_hf(hf, tmp_path / "hf"), mtp_depths=0)
    ids = _ids(cfg)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        p = dict(model.named_parameters()) | dict(model.named_buffers())
        t = p[param]
        if param.endswith("score_bias"):
            t.copy_(-t)  # flips some top-k choices
        elif param.endswith("gate_up"):
            t.copy_(torch.cat(t.chunk(2, dim=0)[::-1], dim=0))  # swap gate and up rows
        else:
            t.mul_(0.5)
        ours = model.logits(model(ids))
    assert (ours - theirs).abs().max() > 100 * ATOL


# --------------------------------------------------------------------------- MTP vs HF
def _mtp_checkpoint(tmp_path, cfg, seed: int = 3):
    """HF main model + HF MtpModel, written as an HF-layout checkpoint with MTP tensors."""
    hf = build_hf_causal_lm(cfg, seed=seed, with_mtp=True)
    mtp = build_hf_mtp(hf, seed=seed + 10)
    path = save_hf(hf, tmp_path / "hf_mtp")
    tensors = load_file(str(path / "model.safetensors"))
    assert not any(n.startswith("model.mtp.") for n in tensors)
    tensors.update(hf_mtp_tensors(mtp))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return hf, mtp, path


def _hf_forward_layer_windowed(mtp, depth: int, hidden, positions, token_ids):
    """HF MtpLayer + shared post norm with the attention mask HF's backbone uses for the layer kind.

    ``MtpModel.forward_layer`` builds a plain causal mask for ``hybrid_sliding`` depths
    (``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING['hybrid_sliding']`` maps to ``create_causal_mask``),
    so its sliding-window depths attend beyond the window on spans longer than it. This calls the
    same HF layer with HF's own sliding-window mask instead.
    """
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    embeds = mtp.embed_tokens(token_ids)
    kw = dict(
        config=mtp.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None, position_ids=positions
    )
    local = mtp.config.layer_types[depth] == "hybrid_sliding"
    mask = create_sliding_window_causal_mask(**kw) if local else create_causal_mask(**kw)
    out = mtp.layers[depth](
        embeds,
        hidden,
        position_embeddings=None,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=None,
        conv_mask=None,
    )
    return mtp.shared_post_norm(out) if mtp.use_shared_post_norm else out


MTP_CASES = {
    # all MTP depths global (log scaling), chained post norm; long span, plain MtpModel.forward_layer
    "global_depths": (dict(mtp=MtpConfig(3, True, [])), 40, "forward_layer"),
    # local and global depths, no chained norm; span within the window, plain MtpModel.forward_layer
    "mixed_depths_short": (dict(mtp=MtpConfig(3, False, [0, 2])), 9, "forward_layer"),
    # local and global depths over a long span: HF layer with HF's sliding-window mask
    "mixed_depths_long": (dict(mtp=MtpConfig(3, True, [0, 2])), 40, "windowed"),
}


@pytest.mark.parametrize("case", list(MTP_CASES))
def test_mtp_parity_with_hf_mtp_model(tmp_path, case):
    overrides, length, how = MTP_CASES[case]
    torch.manual_seed(0)
    cfg = tiny_config(**overrides)
    D = cfg.mtp.num_nextn_predict_layers
    hf, mtp, path = _mtp_checkpoint(tmp_path, cfg)
    assert mtp.use_shared_post_norm == cfg.mtp.chain_hidden_post_norm
    assert mtp.config.layer_types == ["hybrid_sliding" if d in cfg.mtp.local_layer_ids else "hybrid" for d in range(D)]

    model, ckpt = load_model(path, embed_source="raw")
    assert ckpt.layout == "hf" and model.num_mtp_depths == D
    assert ckpt.config == cfg

    ids = _ids(cfg, length=length, seed=5)
    with torch.no_grad():
        h = hf.model(input_ids=ids).last_hidden_state  # the target's final-normed hidden states
        assert (model(ids) - h).abs().max() <= ATOL
        ours = model.mtp_chain(h, ids)
        assert len(ours) == D

        g = h
        for d in range(D):
            # depth d at position t reads g_d[t] and token x[t+d+1]: valid for t < T-d-1
            L = length - d - 1
            positions = torch.arange(L).expand(B, L)
            if how == "forward_layer":
                g = mtp.forward_layer(d, g[:, :L], positions, None, input_ids=ids[:, d + 1 :])
            else:
                g = _hf_forward_layer_windowed(mtp, d, g[:, :L], positions, ids[:, d + 1 :])
            assert g.shape == (B, L, cfg.hidden_size)
            assert g.abs().max() > 0.5
            diff = (ours[d][:, :L] - g).abs().max().item()
            assert diff <= ATOL, f"depth {d}: max |hidden diff| = {diff:.3g}"
            theirs_logits = mtp._project_to_logits(g)
            ours_logits = model.logits(ours[d][:, :L])
            assert theirs_logits.abs().max() > 0.5
            diff = (ours_logits - theirs_logits).abs().max().item()
            assert diff <= ATOL, f"depth {d}: max |logit diff| = {diff:.3g}"

        # asking for fewer depths reads only those, and they are the same
        fewer, _ = load_model(path, mtp_depths=D - 1, embed_source="raw")
        assert fewer.num_mtp_depths == D - 1
        for a, b in zip(fewer.mtp_chain(h, ids), ours[: D - 1]):
            assert torch.equal(a, b)

        # the default embedding source (backbone_norm) is not what HF 5.23 computes
        default, _ = load_model(path)
        other = default.mtp_chain(h, ids)[0][:, : length - 1]
        assert (other - ours[0][:, : length - 1]).abs().max() > 1e-2


def test_hf_mtp_forward_layer_ignores_sliding_window(tmp_path):
    """Documents the HF 5.23 behaviour the windowed helper works around: on a span longer than
    the window, MtpModel.forward_layer differs from the same layer under a sliding-window mask
    for a local depth (and only there)."""
    torch.manual_seed(0)
    cfg = tiny_config(mtp=MtpConfig(2, False, [0]))
    hf = build_hf_causal_lm(cfg, seed=3, with_mtp=True)
    mtp = build_hf_mtp(hf, seed=13)
    ids = _ids(cfg, length=T, seed=5)
    with torch.no_grad():
        h = hf.model(input_ids=ids).last_hidden_state
        L = T - 1
        pos = torch.arange(L).expand(B, L)
        plain = mtp.forward_layer(0, h[:, :L], pos, None, input_ids=ids[:, 1:])
        windowed = _hf_forward_layer_windowed(mtp, 0, h[:, :L], pos, ids[:, 1:])
    w = cfg.sliding_window
    assert torch.allclose(plain[:, :w], windowed[:, :w], atol=1e-6)
    assert (plain[:, w:] - windowed[:, w:]).abs().max() > 1e-2


# --------------------------------------------------------------------------- MTP vs docs/design.md §1
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _reference_chain(model: InklingLM, hidden: torch.Tensor, ids: torch.Tensor, embed_source: str):
    """Design §2 restated: depth d at position t reads g_d[t] and x[t+d+1]; only valid positions.

    Returns [(g_{d+1} [B, L_d, H], logits_d [B, L_d, V])] with L_d = T - d - 1.
    """
    cfg = model.cfg
    eps = cfg.rms_norm_eps
    E = model.backbone.embed.weight
    _, length = ids.shape
    out, g = [], hidden
    for d in range(model.num_mtp_depths):
        depth = model.mtp.depths[d]
        L = length - d - 1
        tokens = ids[:, d + 1 :]  # x[t+d+1] for t = 0..L-1
        e = E[tokens]
        if embed_source == "backbone_norm":
            e = _rms(e, model.backbone.embed_norm.weight, eps)
        z = torch.cat([_rms(g[:, :L], depth.hidden_norm.weight, eps), _rms(e, depth.embed_norm.weight, eps)], -1)
        z = F.linear(z, depth.input_proj.weight)  # hidden first, 2H -> H
        o = depth.block(z, torch.arange(L).expand(ids.shape[0], L))
        if cfg.mtp.chain_hidden_post_norm:
            o = _rms(o, model.mtp.chain_norm.weight, eps)
        logits = F.linear(o / cfg.logits_mup_width_multiplier, model.unembed.weight)[..., : cfg.logits_vocab_size]
        out.append((o, logits))
        g = o
    return out


def _check_against_reference(model: InklingLM, ids: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        h = model(ids)
        ours = model.mtp_chain(h, ids)
        ref = _reference_chain(model, h, ids, model.embed_source)
    assert len(ours) == len(ref) == model.num_mtp_depths
    for d, (g, (rg, rlogits)) in enumerate(zip(ours, ref)):
        L = rg.shape[1]
        assert g.shape == (ids.shape[0], ids.shape[1], model.cfg.hidden_size)
        assert rg.abs().max() > 0.5
        torch.testing.assert_close(g[:, :L], rg, atol=1e-5, rtol=0, msg=lambda m, d=d: f"depth {d}: {m}")
        torch.testing.assert_close(
            model.logits(g[:, :L]), rlogits, atol=1e-5, rtol=0, msg=lambda m, d=d: f"depth {d} logits: {m}"
        )
    return ours


def test_mtp_chain_matches_design_restatement(model):
    ids = _ids(model.cfg)
    assert model.embed_source == "backbone_norm"
    default = _check_against_reference(model, ids)

    raw = InklingLM(model.cfg, mtp_depths=model.num_mtp_depths, embed_source="raw").eval()
    raw.load_state_dict(model.state_dict())
    raw_out = _check_against_reference(raw, ids)
    for d in range(model.num_mtp_depths):
        L = T - d - 1
        assert (raw_out[d][:, :L] - default[d][:, :L]).abs().max() > 1e-2


def test_mtp_chain_matches_design_restatement_without_chain_norm():
    from helpers.models import randomize_

    cfg = tiny_config(mtp=MtpConfig(2, False, [1]))
    torch.manual_seed(0)
    m = randomize_(InklingLM(cfg, mtp_depths=2), seed=4).eval()
    assert m.mtp.chain_norm is None
    _check_against_reference(m, _ids(cfg, seed=9))
