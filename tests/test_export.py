"""Export (release layout) -> load round trips, sharding, atomic replacement, tokenizer copy,
and the exported directory read by Hugging Face transformers 5.23."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference.hf import TINY_AUDIO, TINY_VISION

from helpers.models import randomize_
from inkfw.checkpoint import INDEX_FILE, SINGLE_FILE
from inkfw.models.inkling.checkpoint import export_checkpoint, load_model, open_checkpoint
from inkfw.models.inkling.model import InklingLM

B, T = 2, 40


def _ids(cfg, length: int = T, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (B, length), generator=g)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return model.state_dict()


def _assert_same_model(a: InklingLM, b: InklingLM) -> None:
    """Every state_dict entry bit-equal (and same dtype), same logits and MTP chain outputs."""
    sa, sb = _state(a), _state(b)
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name
    ids = _ids(a.cfg)
    with torch.no_grad():
        ha, hb = a(ids), b(ids)
        assert torch.equal(ha, hb)
        assert torch.equal(a.logits(ha), b.logits(hb))
        ca, cb = a.mtp_chain(ha, ids), b.mtp_chain(hb, ids)
    assert len(ca) == len(cb) == a.num_mtp_depths
    for x, y in zip(ca, cb):
        assert torch.equal(x, y)


def _leftovers(parent: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


def test_export_roundtrip_single_file(model, tmp_path):
    assert model.num_mtp_depths == 3
    out = export_checkpoint(model, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    assert (out / SINGLE_FILE).is_file() and not (out / INDEX_FILE).exists()
    assert (out / "config.json").is_file()
    assert _leftovers(tmp_path, {"ckpt"}) == []

    loaded, ckpt = load_model(out)
    assert ckpt.layout == "release"
    assert ckpt.config == model.cfg
    assert loaded.num_mtp_depths == 3
    _assert_same_model(model, loaded)

    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "inkling_mm_model"
    assert raw["mtp_config"] == {
        "num_nextn_predict_layers": 3,
        "chain_hidden_post_norm": True,
        "local_layer_ids": [0, 2],
    }
    # release names, gate/up interleaved in w13 tensors
    names = set(ckpt.weight_map)
    assert "model.llm.layers.0.mlp.w13_dn.weight" in names
    assert "model.mtp.layers.2.transformer_block.mlp.w13_dn.weight" in names
    assert "model.mtp.chain_norm.weight" in names
    assert not any(n.startswith(("model.layers.", "lm_head")) for n in names)


def test_export_interleaves_gate_up(model, tmp_path):
    """The release w13 tensors alternate gate and up rows (g0, u0, g1, u1, ...)."""
    from safetensors import safe_open

    out = export_checkpoint(model, tmp_path / "ckpt")
    with safe_open(str(out / SINGLE_FILE), framework="pt") as f:
        w13 = f.get_tensor("model.llm.layers.0.mlp.w13_dn.weight")
        experts = f.get_tensor("model.llm.layers.1.mlp.experts.w13_weight")
    gate, up = model.backbone.layers[0].mlp.gate_up.detach().chunk(2, dim=0)
    assert torch.equal(w13[0::2], gate) and torch.equal(w13[1::2], up)
    egate, eup = model.backbone.layers[1].mlp.experts_gate_up.detach().chunk(2, dim=1)
    assert torch.equal(experts[:, 0::2], egate) and torch.equal(experts[:, 1::2], eup)


def test_export_fewer_depths_records_them(cfg, tmp_path):
    torch.manual_seed(0)
    m = randomize_(InklingLM(cfg, mtp_depths=2), seed=3).eval()
    out = export_checkpoint(m, tmp_path / "two")
    assert json.loads((out / "config.json").read_text())["mtp_config"]["num_nextn_predict_layers"] == 2
    loaded, ckpt = load_model(out)
    assert loaded.num_mtp_depths == 2
    assert not any(n.startswith("model.mtp.layers.2.") for n in ckpt.weight_map)
    _assert_same_model(m, loaded)


def test_export_sharded(model, tmp_path):
    out = export_checkpoint(model, tmp_path / "sharded", max_shard_bytes=16 * 1024)
    index = json.loads((out / INDEX_FILE).read_text())
    assert not (out / SINGLE_FILE).exists()
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) >= 3
    assert sorted(set(index["weight_map"].values())) == files
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert index["metadata"]["total_size"] == total

    loaded, ckpt = load_model(out)
    assert set(ckpt.weight_map.values()) == {out / f for f in files}
    _assert_same_model(model, loaded)

    # same tensors, bit for bit, as a single-file export
    single, _ = load_model(export_checkpoint(model, tmp_path / "single"))
    _assert_same_model(single, loaded)


def test_export_replaces_existing_directory(model, cfg, tmp_path):
    out = tmp_path / "ckpt"
    # first: a sharded export of another model, plus a stray file of the user's
    torch.manual_seed(0)
    other = randomize_(InklingLM(cfg, mtp_depths=1), seed=7).eval()
    export_checkpoint(other, out, max_shard_bytes=16 * 1024)
    (out / "stale.txt").write_text("old")
    assert (out / INDEX_FILE).is_file()

    export_checkpoint(model, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE]
    assert _leftovers(tmp_path, {"ckpt"}) == []  # no temporary or old directories left behind
    loaded, _ = load_model(out)
    _assert_same_model(model, loaded)


def test_failed_export_keeps_existing_checkpoint(model, cfg, tmp_path):
    out = tmp_path / "ckpt"
    export_checkpoint(model, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    torch.manual_seed(0)
    other = randomize_(InklingLM(cfg, mtp_depths=1), seed=7).eval()
    with pytest.raises(FileNotFoundError):
        export_checkpoint(other, out, tokenizer_json=tmp_path / "missing-tokenizer.json")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert _leftovers(tmp_path, {"ckpt"}) == []


def test_export_copies_tokenizer_and_extra_config(model, tmp_path):
    tok = tmp_path / "src" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_bytes(json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}}}).encode() + b"\n\x00")
    extra = {
        "vision_config": dict(TINY_VISION),
        "audio_config": dict(TINY_AUDIO),
        "image_token_id": 77,
        "model_type": "ignored",
        "text_config": {"ignored": True},
    }
    out = export_checkpoint(model, tmp_path / "ckpt", tokenizer_json=tok, extra_config=extra)
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert open_checkpoint(out).tokenizer_path == out / "tokenizer.json"
    raw = json.loads((out / "config.json").read_text())
    assert raw["vision_config"] == TINY_VISION and raw["audio_config"] == TINY_AUDIO
    assert raw["image_token_id"] == 77
    assert raw["model_type"] == "inkling_mm_model" and "ignored" not in raw["text_config"]

    no_tok = export_checkpoint(model, tmp_path / "plain")
    assert not (no_tok / "tokenizer.json").exists()
    assert open_checkpoint(no_tok).tokenizer_path is None

    # re-exporting over a checkpoint with its own tokenizer.json as the source keeps it
    export_checkpoint(model, out, tokenizer_json=out / "tokenizer.json")
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert _leftovers(tmp_path, {"src", "ckpt", "plain"}) == []


def _names(file: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("max_shard_bytes", [None, 16 * 1024])
def test_export_mtp_file(model, tmp_path, max_shard_bytes):
    """mtp_file=True: the depths (and the chain norm) in mtp.safetensors, nothing else there, the
    main tensors in model-*.safetensors, an index listing every tensor; it loads back bit-equal."""
    everything = _names(export_checkpoint(model, tmp_path / "plain") / SINGLE_FILE)
    out = export_checkpoint(model, tmp_path / "ckpt", mtp_file=True, max_shard_bytes=max_shard_bytes)
    mtp_names = _names(out / "mtp.safetensors")
    assert mtp_names == {n for n in everything if n.startswith("model.mtp.")}
    assert "model.mtp.chain_norm.weight" in mtp_names and any(".layers.2." in n for n in mtp_names)
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert shards and (len(shards) > 1) == (max_shard_bytes is not None)
    main_names = set().union(*(_names(out / shard) for shard in shards))
    assert not main_names & mtp_names and main_names | mtp_names == everything
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    assert {n for n, f in weight_map.items() if f == "mtp.safetensors"} == mtp_names
    assert set(weight_map) == main_names | mtp_names and not (out / SINGLE_FILE).exists()

    loaded, ckpt = load_model(out)
    assert ckpt.layout == "release" and ckpt.side_files == [out / "mtp.safetensors"]
    _assert_same_model(model, loaded)


def test_export_mtp_file_without_depths(cfg, tmp_path):
    torch.manual_seed(0)
    plain = randomize_(InklingLM(cfg, mtp_depths=0), seed=3).eval()
    out = export_checkpoint(plain, tmp_path / "ckpt", mtp_file=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", SINGLE_FILE]


# --------------------------------------------------------------------------- read by HF
def _hf_from_export(model, tmp_path, **kw):
    from transformers import InklingForConditionalGeneration

    # the release config carries the towers' configs; an export passes them through extra_config
    out = export_checkpoint(
        model,
        tmp_path / "for_hf",
        extra_config={"vision_config": dict(TINY_VISION), "audio_config": dict(TINY_AUDIO)},
        **kw,
    )
    hf = InklingForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    return hf, out


@pytest.mark.parametrize("sharded", [False, True])
def test_hf_reads_exported_checkpoint(model, tmp_path, sharded):
    hf, out = _hf_from_export(model, tmp_path, max_shard_bytes=16 * 1024 if sharded else None)
    assert (out / INDEX_FILE).is_file() == sharded
    ids = _ids(model.cfg)
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        ours = model.logits(model(ids))
    assert theirs.shape == ours.shape == (B, T, model.cfg.logits_vocab_size)
    assert theirs.abs().max() > 0.5
    assert (theirs - ours).abs().max() <= 1e-4


@pytest.mark.parametrize("mtp_file", [False, True])
def test_hf_mtp_model_reads_exported_depths(model, tmp_path, mtp_file):
    """HF's MtpModel.from_pretrained reads the exported model.mtp.* tensors (release names,
    interleaved w13 in the depth blocks), also from mtp.safetensors through the index; with HF's
    raw-embedding convention the chains agree."""
    from transformers.modeling_layers import MtpModel

    hf, out = _hf_from_export(model, tmp_path, mtp_file=mtp_file)
    assert (out / "mtp.safetensors").is_file() == mtp_file
    mtp = MtpModel.from_pretrained(hf).float().eval()
    assert len(mtp.layers) == model.num_mtp_depths and mtp.use_shared_post_norm

    raw = InklingLM(model.cfg, mtp_depths=model.num_mtp_depths, embed_source="raw").eval()
    raw.load_state_dict(model.state_dict())
    # MtpModel.forward_layer gives sliding-window depths a plain causal mask (HF 5.23), so the
    # span stays within the window: T - 1 <= sliding_window
    length = model.cfg.sliding_window + 1
    ids = _ids(model.cfg, length=length, seed=3)
    with torch.no_grad():
        h = raw(ids)
        ours = raw.mtp_chain(h, ids)
        g = h
        for d in range(model.num_mtp_depths):
            L = length - d - 1
            g = mtp.forward_layer(d, g[:, :L], torch.arange(L).expand(B, L), None, input_ids=ids[:, d + 1 :])
            assert g.abs().max() > 0.5
            assert (g - ours[d][:, :L]).abs().max() <= 1e-4, f"depth {d}"
            assert (mtp._project_to_logits(g) - raw.logits(ours[d][:, :L])).abs().max() <= 1e-4
