"""Every tensor spelling HF transformers 5.23 loads for Inkling loads in inkfw, with HF parity.

HF's conversion mapping for ``inkling_mm_model`` renames each part of a name on its own, so a
checkpoint may use the release or the HF name for each tensor, under any of several roots
(``model.llm.``, ``model.language_model.``, its base-prefix and legacy variants); ``inkling_text``
(``InklingForCausalLM``) has no mapping but the base-model prefix rule; MTP depths follow HF's
``MtpModel`` mapping. Each fixture below renames the tensors of an HF model into one spelling; HF
itself must load it back to the same logits (so the spelling is one HF accepts), and inkfw must
match HF within 1e-4.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from reference.hf import build_hf_causal_lm, build_hf_mm_model, build_hf_mtp, hf_mtp_tensors, save_hf
from safetensors.torch import save_file

from helpers.models import tiny_config
from inkfw.models.inkling.checkpoint import load_model
from inkfw.models.inkling.config import MtpConfig

ATOL = 1e-4
B, T = 2, 40  # T > sliding_window (8) and rel_extent (16)

# HF name -> release name of block tensors (HF 5.23 conversion_mapping.py, "inkling_mm_model")
ATTN_RELEASE = [
    ("self_attn.q_proj", "attn.wq_du"),
    ("self_attn.k_proj", "attn.wk_dv"),
    ("self_attn.v_proj", "attn.wv_dv"),
    ("self_attn.r_proj", "attn.wr_du"),
    ("self_attn.o_proj", "attn.wo_ud"),
    ("self_attn.q_norm", "attn.q_norm"),
    ("self_attn.k_norm", "attn.k_norm"),
    ("self_attn.k_sconv.conv1d", "attn.k_sconv"),
    ("self_attn.v_sconv.conv1d", "attn.v_sconv"),
    ("self_attn.rel_logits_proj", "attn.rel_logits_proj"),
    ("attn_sconv.conv1d", "attn_sconv"),
    ("mlp_sconv.conv1d", "mlp_sconv"),
    ("post_attention_layernorm", "mlp_norm"),
    ("input_layernorm", "attn_norm"),
]
MLP_RELEASE = [
    ("mlp.down_proj.weight", "mlp.w2_md.weight"),
    ("mlp.experts.down_proj", "mlp.experts.w2_weight"),
    ("mlp.shared_experts.down_proj", "mlp.shared_experts.shared_w2_weight"),
    ("mlp.gate.e_score_correction_bias", "mlp.gate.bias"),
]
# where the text model sits: (block prefix, embed, embed norm, final norm, unembedding)
RELEASE_ROOT = (
    "model.llm.layers.",
    "model.llm.embed.weight",
    "model.llm.embed_norm.weight",
    "model.llm.norm.weight",
    "model.llm.unembed.weight",
)


def hf_root(base: str, unembed: str = "lm_head.weight") -> tuple[str, ...]:
    return (
        f"{base}layers.",
        f"{base}embed_tokens.weight",
        f"{base}embed_tokens.embed_norm.weight",
        f"{base}norm.weight",
        unembed,
    )


MM_ROOTS = {
    "release": RELEASE_ROOT,
    "mm": hf_root("model.language_model."),
    "mm_bare": hf_root("language_model."),
    "mm_doubled": hf_root("model.model.language_model.", "model.lm_head.weight"),
    "legacy": hf_root("model.language_model.model."),
    "legacy_bare": hf_root("language_model.model.model."),
}
TEXT_ROOTS = {"text_bare": hf_root(""), "text_doubled": hf_root("model.model.", "model.lm_head.weight")}


def interleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[gate..., up...] -> [g0, u0, g1, u1, ...] along ``dim`` (the release w13 tensors)."""
    return t.unflatten(dim, (2, -1)).transpose(dim, dim + 1).flatten(dim, dim + 1)


def release_block(block: dict[str, torch.Tensor], attn: bool, mlp: bool) -> dict[str, torch.Tensor]:
    """One block's HF-named tensors with the attention part (``attn``) and/or the MLP part
    (``mlp``) renamed to release names, gate/up fused and interleaved as the release stores them."""
    out = dict(block)
    if mlp:
        if "mlp.gate_proj.weight" in out:
            out["mlp.w13_dn.weight"] = interleave(
                torch.cat([out.pop("mlp.gate_proj.weight"), out.pop("mlp.up_proj.weight")], 0), 0
            )
        if "mlp.experts.gate_up_proj" in out:
            out["mlp.experts.w13_weight"] = interleave(out.pop("mlp.experts.gate_up_proj"), 1)
            out["mlp.shared_experts.shared_w13_weight"] = interleave(
                torch.cat([out.pop("mlp.shared_experts.gate_proj"), out.pop("mlp.shared_experts.up_proj")], 1), 1
            )
    renames = (ATTN_RELEASE if attn else []) + (MLP_RELEASE if mlp else [])
    renamed = {}
    for name, t in out.items():
        for hf, rel in renames:
            if name.startswith(hf):
                name = rel + name[len(hf) :]
                break
        renamed[name] = t
    return renamed


def split_native(state: dict[str, torch.Tensor], base: str):
    """HF-native tensors -> (per-layer blocks, top-level tensors by role, everything else)."""
    blocks: dict[int, dict[str, torch.Tensor]] = {}
    top, other = {}, {}
    roles = {
        f"{base}embed_tokens.weight": 1,
        f"{base}embed_tokens.embed_norm.weight": 2,
        f"{base}norm.weight": 3,
        "lm_head.weight": 4,
    }
    for name, t in state.items():
        m = re.match(rf"^{re.escape(base)}layers\.(\d+)\.(.+)$", name)
        if m:
            blocks.setdefault(int(m.group(1)), {})[m.group(2)] = t
        elif name in roles:
            top[roles[name]] = t
        else:
            other[name] = t
    return blocks, top, other


def respell(state: dict[str, torch.Tensor], base: str, pick) -> dict[str, torch.Tensor]:
    """Rename an HF-native state dict: ``pick(what)`` -> (root, attention in release names, MLP in
    release names) for each layer ``what`` = i and each top-level tensor ``what`` = "top"."""
    blocks, top, other = split_native(state, base)
    out = dict(other)
    for role, t in top.items():
        out[pick("top")[0][role]] = t
    for i, block in blocks.items():
        root, attn, mlp = pick(i)
        out.update({f"{root[0]}{i}.{n}": t for n, t in release_block(block, attn, mlp).items()})
    return out


def write(path: Path, tensors: dict[str, torch.Tensor], config_from: Path) -> Path:
    path.mkdir(parents=True)
    save_file(
        {n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    (path / "config.json").write_text((config_from / "config.json").read_text())
    return path


def _ids(cfg, length: int = T, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, length), generator=torch.Generator().manual_seed(seed))


def _check(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape and theirs.abs().max() > 0.5
    diff = (ours - theirs).abs().max().item()
    assert diff <= ATOL, f"max |logit diff| = {diff:.3g}"


# --------------------------------------------------------------------------- backbone (mm)
MM_FIXTURES = {
    # the community 0.6B layout: release names, HF-style MLP names
    "release_with_hf_mlp_names": lambda rng, what: (MM_ROOTS["release"], True, False),
    "release_root_hf_blocks": lambda rng, what: (MM_ROOTS["release"], False, False),
    "hf_native": lambda rng, what: (MM_ROOTS["mm"], False, False),
    "hf_root_release_blocks": lambda rng, what: (MM_ROOTS["mm"], True, True),
    "bare_root_mixed_blocks": lambda rng, what: (MM_ROOTS["mm_bare"], what == 0, what != 1),
    "doubled_root": lambda rng, what: (MM_ROOTS["mm_doubled"], False, True),
    "legacy_root": lambda rng, what: (MM_ROOTS["legacy"], True, False),
    "legacy_bare_root": lambda rng, what: (MM_ROOTS["legacy_bare"], False, False),
    # every layer and the top-level tensors each pick a root and names at random
    "per_tensor_mix": lambda rng, what: (
        MM_ROOTS[rng.choice(sorted(MM_ROOTS))],
        rng.random() < 0.5,
        rng.random() < 0.5,
    ),
}


@pytest.fixture(scope="module")
def mm_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tiny_config()  # dense layer 0, MoE layers 1-3, local and global attention
    hf = build_hf_mm_model(cfg, seed=2)
    saved = save_hf(hf, tmp_path_factory.mktemp("mm") / "saved")
    with torch.no_grad():
        reference = hf(input_ids=_ids(cfg)).logits
    return cfg, hf, saved, reference


@pytest.mark.parametrize("fixture", list(MM_FIXTURES))
def test_mm_spellings_load_with_hf_parity(mm_model, tmp_path, fixture):
    from transformers import InklingForConditionalGeneration

    cfg, hf, saved, reference = mm_model
    rng = random.Random(fixture)
    tensors = respell(hf.state_dict(), "model.language_model.", lambda what: MM_FIXTURES[fixture](rng, what))
    if fixture == "hf_native":
        assert set(tensors) == set(hf.state_dict())
    path = write(tmp_path / fixture, tensors, saved)

    theirs = InklingForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32).eval()
    model, ckpt = load_model(path, mtp_depths=0)
    assert ckpt.layout == "mixed"
    with torch.no_grad():
        assert (theirs(input_ids=_ids(cfg)).logits - reference).abs().max() <= 1e-5  # HF accepts this spelling
        _check(model.logits(model(_ids(cfg))), reference)


# --------------------------------------------------------------------------- backbone (inkling_text)
@pytest.mark.parametrize("root", list(TEXT_ROOTS))
def test_causal_lm_spellings_load_with_hf_parity(tmp_path, root):
    """InklingForCausalLM's names without or with a doubled base-model prefix (HF adds or strips it)."""
    from transformers import InklingForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config()
    hf = build_hf_causal_lm(cfg, seed=1)
    saved = save_hf(hf, tmp_path / "saved")
    tensors = respell(hf.state_dict(), "model.", lambda what: (TEXT_ROOTS[root], False, False))
    assert not any(n.startswith("model.layers.") for n in tensors)
    path = write(tmp_path / root, tensors, saved)

    theirs = InklingForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model, ckpt = load_model(path, mtp_depths=0)
    assert ckpt.layout == "mixed"
    ids = _ids(cfg)
    with torch.no_grad():
        reference = hf(input_ids=ids).logits
        assert (theirs(input_ids=ids).logits - reference).abs().max() <= 1e-5
        _check(model.logits(model(ids)), reference)


# --------------------------------------------------------------------------- MTP depths
OWN = {
    "release": ("hidden_norm", "embed_norm", "input_proj"),
    "hf": ("hnorm", "enorm", "eh_proj"),
    "hf_nested": ("mtp_block.hnorm", "mtp_block.enorm", "mtp_block.eh_proj"),
}
MTP_FIXTURES = {  # (own tensors' names, where the block sits, chain norm name)
    "hf_names": ("hf", "mtp_block.", "shared_post_norm"),
    "nested_own_names": ("hf_nested", "mtp_block.", "chain_norm"),
    "block_directly_under_depth": ("release", "", "shared_post_norm"),
    "hf_own_names_transformer_block": ("hf", "transformer_block.", "chain_norm"),
}


def respell_mtp(tensors: dict[str, torch.Tensor], own: str, block: str, chain: str) -> dict[str, torch.Tensor]:
    """``model.mtp.*`` tensors in inkfw's HF layout (hidden_norm, transformer_block.) -> another spelling."""
    out = {}
    for name, t in tensors.items():
        if name == "model.mtp.chain_norm.weight":
            out[f"model.mtp.{chain}.weight"] = t
            continue
        m = re.match(r"^model\.mtp\.layers\.(\d+)\.(.+)$", name)
        if m is None:
            out[name] = t
            continue
        d, rest = m.groups()
        for ours, theirs in zip(OWN["release"], OWN[own]):
            if rest == f"{ours}.weight":
                rest = f"{theirs}.weight"
        if rest.startswith("transformer_block."):
            rest = block + rest.removeprefix("transformer_block.")
        out[f"model.mtp.layers.{d}.{rest}"] = t
    return out


@pytest.mark.parametrize("fixture", list(MTP_FIXTURES))
def test_mtp_spellings_load_with_hf_parity(tmp_path, fixture):
    from safetensors.torch import load_file
    from transformers import InklingForCausalLM
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(0)
    cfg = tiny_config(mtp=MtpConfig(3, True, [0, 2]))
    hf = build_hf_causal_lm(cfg, seed=3, with_mtp=True)
    mtp = build_hf_mtp(hf, seed=13)
    saved = save_hf(hf, tmp_path / "saved")
    tensors = load_file(str(saved / "model.safetensors"))
    tensors.update(respell_mtp(hf_mtp_tensors(mtp), *MTP_FIXTURES[fixture]))
    path = write(tmp_path / fixture, tensors, saved)

    # HF reads the depths back from this spelling
    theirs = MtpModel.from_pretrained(InklingForCausalLM.from_pretrained(str(path), dtype=torch.float32)).eval()
    want = mtp.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in theirs.state_dict().items() if k in want)
    assert {k for k in want if "embed_tokens" not in k and "shared_head" not in k} <= set(theirs.state_dict())

    model, ckpt = load_model(path, embed_source="raw")  # HF 5.23 feeds MTP depths the raw embedding
    assert ckpt.layout == "mixed" and model.num_mtp_depths == 3
    # MtpModel.forward_layer masks sliding-window depths causally only: stay within the window
    length = cfg.sliding_window + 1
    ids = _ids(cfg, length=length, seed=5)
    with torch.no_grad():
        h = hf.model(input_ids=ids).last_hidden_state
        ours = model.mtp_chain(h, ids)
        g = h
        for d in range(3):
            L = length - d - 1
            g = mtp.forward_layer(d, g[:, :L], torch.arange(L).expand(B, L), None, input_ids=ids[:, d + 1 :])
            _check(model.logits(ours[d][:, :L]), mtp._project_to_logits(g))


def test_written_layouts_are_named(mm_model, tmp_path):
    """The two layouts writers produce are recognised as such; anything else reads as mixed."""
    _, hf, saved, _ = mm_model
    assert load_model(saved, mtp_depths=0)[1].layout == "release"
    tensors = respell(hf.state_dict(), "model.language_model.", lambda what: (MM_ROOTS["release"], True, what != 2))
    assert load_model(write(tmp_path / "mixed", tensors, saved), mtp_depths=0)[1].layout == "mixed"
    raw = json.loads((saved / "config.json").read_text())
    assert raw["model_type"] == "inkling_mm_model"


def test_every_spelling_names_one_tensor():
    """No checkpoint name is a spelling of two inkfw tensors (dense and MoE blocks, MTP, chain norm)."""
    from inkfw.models.inkling.state_dict import spellings

    owner: dict[str, str] = {}
    for param, maps in spellings(tiny_config(), 3).items():
        assert len({m.sources for m in maps}) == len(maps) > 0, param
        for m in maps:
            for name in m.sources:
                assert owner.setdefault(name, param) == param, name
    assert owner["model.llm.layers.0.mlp.w13_dn.weight"] == owner["model.layers.0.mlp.up_proj.weight"]
