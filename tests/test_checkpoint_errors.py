"""Checkpoint loading: every bad input is one clear error naming the file or tensor; the
positive paths (skipped towers, fewer MTP depths, no tokenizer, bf16) load what they should."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.models import randomize_, tiny_config
from inkfw.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from inkfw.errors import CheckpointError, ConfigError, InkfwError
from inkfw.models.inkling.checkpoint import export_checkpoint, load_model, open_checkpoint
from inkfw.models.inkling.layers import Router, ShortConv
from inkfw.models.inkling.model import InklingLM

# tensors of the release layout used below (all "copy" tensors, no interleave)
Q_PROJ = "model.llm.layers.1.attn.wq_du.weight"
NORM = "model.llm.norm.weight"


@pytest.fixture(scope="module")
def source_model() -> InklingLM:
    torch.manual_seed(0)
    return randomize_(InklingLM(tiny_config(), mtp_depths=3), seed=1).eval()


@pytest.fixture(scope="module")
def exported(source_model, tmp_path_factory) -> Path:
    tok = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.write_text("{}")
    return export_checkpoint(source_model, tmp_path_factory.mktemp("ckpt") / "single", tokenizer_json=tok)


@pytest.fixture(scope="module")
def exported_sharded(source_model, tmp_path_factory) -> Path:
    return export_checkpoint(source_model, tmp_path_factory.mktemp("ckpt") / "sharded", max_shard_bytes=20_000)


@pytest.fixture
def ckpt(exported, tmp_path) -> Path:
    """A private, mutable copy of the single-file checkpoint."""
    return Path(shutil.copytree(exported, tmp_path / "ckpt"))


@pytest.fixture
def sharded(exported_sharded, tmp_path) -> Path:
    return Path(shutil.copytree(exported_sharded, tmp_path / "sharded"))


def rewrite(file: Path, edit) -> None:
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def index_of(path: Path) -> dict:
    return json.loads((path / INDEX_FILE).read_text())


def assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


# ----------------------------------------------------------------------- sanity
def test_valid_checkpoint_round_trips(exported, source_model):
    model, ck = load_model(exported)
    assert ck.layout == "release"
    assert model.num_mtp_depths == 3
    assert_same_params(model, source_model)
    ids = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), source_model(ids), rtol=0, atol=0)


def test_valid_sharded_checkpoint_round_trips(exported_sharded, source_model):
    shards = sorted(p.name for p in exported_sharded.glob("*.safetensors"))
    assert len(shards) > 2 and (exported_sharded / INDEX_FILE).is_file()
    assert not (exported_sharded / SINGLE_FILE).exists()
    model, _ = load_model(exported_sharded)
    assert_same_params(model, source_model)


# ------------------------------------------------------------------ bad inputs
def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="directory not found") as exc:
        load_model(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in str(exc.value)


def test_path_is_a_file(ckpt):
    with pytest.raises(CheckpointError, match="must be a directory") as exc:
        load_model(ckpt / SINGLE_FILE)
    assert SINGLE_FILE in str(exc.value)


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(exc.value)
    assert "not found" in str(exc.value)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "inkling_mm_model",')
    with pytest.raises(CheckpointError, match="not a readable JSON file") as exc:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(exc.value)


def test_config_not_utf8(ckpt):
    (ckpt / "config.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(exc.value)


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"inkling"'])
def test_config_not_an_object(ckpt, text):
    (ckpt / "config.json").write_text(text)
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert str(ckpt / "config.json") in str(exc.value)


def test_unknown_model_type(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    raw["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises((CheckpointError, ConfigError)) as exc:
        load_model(ckpt)
    assert "'llama'" in str(exc.value)
    assert str(ckpt / "config.json") in str(exc.value)


def test_missing_safetensors(ckpt):
    (ckpt / SINGLE_FILE).unlink()
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert SINGLE_FILE in str(exc.value) and INDEX_FILE in str(exc.value)


def test_missing_tensor(ckpt):
    rewrite(ckpt / SINGLE_FILE, lambda t: t.pop(Q_PROJ))
    with pytest.raises(CheckpointError, match="missing tensor") as exc:
        load_model(ckpt)
    assert Q_PROJ in str(exc.value)
    assert SINGLE_FILE in str(exc.value)


def test_missing_mtp_tensor(ckpt):
    name = "model.mtp.layers.1.transformer_block.attn.wk_dv.weight"
    rewrite(ckpt / SINGLE_FILE, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_model(ckpt)


def test_missing_chain_norm(ckpt):
    rewrite(ckpt / SINGLE_FILE, lambda t: t.pop("model.mtp.chain_norm.weight"))
    with pytest.raises(CheckpointError, match=re.escape("model.mtp.chain_norm.weight")):
        load_model(ckpt)


@pytest.mark.parametrize(
    "extra",
    [
        "model.llm.layers.0.attn.something_new.weight",
        "model.mtp.layers.3.hidden_norm.weight",  # a depth beyond those config.json says ship
        "model.visualization.weight",  # looks like a tower, is not one
        "lm_head.weight",  # an HF name inside a release checkpoint
    ],
)
def test_unexpected_tensor(ckpt, extra):
    rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(extra, torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected tensor") as exc:
        load_model(ckpt)
    assert extra in str(exc.value)
    assert SINGLE_FILE in str(exc.value)


@pytest.mark.parametrize(
    "bad, closest",
    [
        ("model.llm.layers.1.attn.wq_du.weights", Q_PROJ),
        ("model.llm.layers.2.mlp.experts.w13_weigth", "model.llm.layers.2.mlp.experts.w13_weight"),
        ("model.llm.layers.1.self_attn.q_proj.weigth", "model.llm.layers.1.self_attn.q_proj.weight"),  # HF block name
        ("model.mtp.layers.0.hidden_normm.weight", "model.mtp.layers.0.hidden_norm.weight"),
        ("model.llm.unembed.weights", "model.llm.unembed.weight"),
    ],
)
def test_unknown_name_gives_the_closest_known_name(ckpt, bad, closest):
    """One sentence: the file, the name, and the closest name an Inkling checkpoint may use."""
    rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(bad, torch.zeros(3)))
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert str(exc.value) == f"{ckpt / SINGLE_FILE}: unexpected tensor {bad} (closest known name: {closest})."


def test_tensor_spelled_twice(ckpt):
    """The release and the HF name of one tensor in one checkpoint: the odd one out is named."""
    extra = "model.llm.layers.0.input_layernorm.weight"
    rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(extra, t["model.llm.layers.0.attn_norm.weight"].clone()))
    with pytest.raises(CheckpointError, match="unexpected tensor") as exc:
        load_model(ckpt)
    assert str(exc.value) == (
        f"{ckpt / SINGLE_FILE}: unexpected tensor {extra}, a second copy of "
        f"model.llm.layers.0.attn_norm.weight in {ckpt / SINGLE_FILE}."
    )


def test_half_of_a_split_tensor(ckpt):
    """HF's gate_proj without its up_proj (the release w13 removed): the missing half is named."""
    w13 = "model.llm.layers.0.mlp.w13_dn.weight"

    def edit(t):
        t["model.llm.layers.0.mlp.gate_proj.weight"] = t.pop(w13)[:48]

    rewrite(ckpt / SINGLE_FILE, edit)
    with pytest.raises(CheckpointError, match="missing tensor model.llm.layers.0.mlp.up_proj.weight"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(Q_PROJ, torch.zeros(5, 32)))
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    msg = str(exc.value)
    assert Q_PROJ in msg and SINGLE_FILE in msg
    assert "[5, 32]" in msg and "[32, 32]" in msg  # got, expected (4 heads x 8 dims, hidden 32)


def test_wrong_shape_of_interleaved_tensor(ckpt):
    name = "model.llm.layers.0.mlp.w13_dn.weight"  # dense gate/up: [2 * 48, 32]
    rewrite(ckpt / SINGLE_FILE, lambda t: t.__setitem__(name, torch.zeros(48, 32)))
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert name in str(exc.value) and "[48, 32]" in str(exc.value) and "[96, 32]" in str(exc.value)


def test_wrong_shape_of_config(ckpt):
    """config.json and the tensors disagree: the error says which tensor, and that config.json set it."""
    raw = json.loads((ckpt / "config.json").read_text())
    raw["text_config"]["hidden_size"] = 40
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="config.json") as exc:
        load_model(ckpt)
    assert re.search(r"tensor model\.\S+ has shape", str(exc.value))


def test_truncated_file(ckpt):
    data = (ckpt / SINGLE_FILE).read_bytes()
    (ckpt / SINGLE_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert str(ckpt / SINGLE_FILE) in str(exc.value)


@pytest.mark.parametrize("garbage", [b"", b"\x00" * 3, b"garbage!" * 64, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}"])
def test_garbage_file(ckpt, garbage):
    (ckpt / SINGLE_FILE).write_bytes(garbage)
    with pytest.raises(CheckpointError) as exc:
        load_model(ckpt)
    assert str(ckpt / SINGLE_FILE) in str(exc.value)


def test_no_text_tensors(ckpt):
    save_file({"model.visual.patch.weight": torch.zeros(2)}, str(ckpt / SINGLE_FILE))
    with pytest.raises(CheckpointError, match="no Inkling text tensors"):
        load_model(ckpt)


def test_index_points_to_missing_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match="not found") as exc:
        load_model(sharded)
    assert str(shard) in str(exc.value)


def test_index_lists_tensor_not_in_its_shard(sharded):
    index = index_of(sharded)
    first = sorted(sharded.glob("model-*.safetensors"))[0]
    index["weight_map"]["model.llm.layers.0.attn.not_there.weight"] = first.name
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        load_model(sharded)
    msg = str(exc.value)
    assert "model.llm.layers.0.attn.not_there.weight" in msg and str(first) in msg


def test_index_moves_tensor_to_wrong_shard(sharded):
    index = index_of(sharded)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    home = index["weight_map"][Q_PROJ]
    index["weight_map"][Q_PROJ] = next(s for s in shards if s != home)
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as exc:
        load_model(sharded)
    assert Q_PROJ in str(exc.value) and index["weight_map"][Q_PROJ] in str(exc.value)


def test_index_missing_a_tensor(sharded):
    index = index_of(sharded)
    del index["weight_map"][Q_PROJ]
    (sharded / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing tensor") as exc:
        load_model(sharded)
    assert Q_PROJ in str(exc.value) and INDEX_FILE in str(exc.value)


@pytest.mark.parametrize("text", ["{broken", '{"metadata": {}}', '{"weight_map": 3}'])
def test_index_not_valid(sharded, text):
    (sharded / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError) as exc:
        load_model(sharded)
    assert str(sharded / INDEX_FILE) in str(exc.value)


def test_truncated_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as exc:
        load_model(sharded)
    assert str(shard) in str(exc.value)


# ------------------------------------------------------------------- positives
@pytest.fixture
def read_log(monkeypatch) -> list[str]:
    """Names of every tensor whose shape or data a load touches."""
    log: list[str] = []
    read, shape = Checkpoint.read, Checkpoint.shape

    def logged_read(self, name):
        log.append(name)
        return read(self, name)

    def logged_shape(self, name):
        log.append(name)
        return shape(self, name)

    monkeypatch.setattr(Checkpoint, "read", logged_read)
    monkeypatch.setattr(Checkpoint, "shape", logged_shape)
    return log


def test_visual_and_audio_towers_are_skipped(ckpt, source_model, read_log):
    towers = {
        "model.visual.patch_embed.weight": torch.ones(4, 3),
        "model.audio.encoder.0.weight": torch.ones(2),
        "model.visual.blocks.0.attn.qkv.weight": torch.ones(6, 2),
    }
    rewrite(ckpt / SINGLE_FILE, lambda t: t.update(towers))
    model, ck = load_model(ckpt)
    assert set(towers) <= set(ck.weight_map)
    assert not set(towers) & set(read_log)
    assert_same_params(model, source_model)


@pytest.mark.parametrize("depths", [0, 1, 2])
def test_fewer_mtp_depths_than_shipped(exported, source_model, read_log, depths):
    model, ck = load_model(exported, mtp_depths=depths)
    assert ck.config.mtp.num_nextn_predict_layers == 3
    assert model.num_mtp_depths == depths
    mtp_read = {int(m.group(1)) for n in read_log if (m := re.match(r"model\.mtp\.layers\.(\d+)\.", n))}
    assert mtp_read == set(range(depths))  # depths >= requested are never read
    assert ("model.mtp.chain_norm.weight" in read_log) == (depths > 0)
    src = source_model.state_dict()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, src[k], rtol=0, atol=0, msg=k)
    if depths:
        ids = torch.randint(0, 90, (1, 9), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            got = model.mtp_chain(model(ids), ids)
            want = source_model.mtp_chain(source_model(ids), ids, num_depths=depths)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_fewer_mtp_depths_from_sharded(exported_sharded, read_log):
    model, _ = load_model(exported_sharded, mtp_depths=1)
    assert model.num_mtp_depths == 1
    assert not any(re.match(r"model\.mtp\.layers\.[12]\.", n) for n in read_log)


def test_more_depths_than_shipped(exported):
    with pytest.raises(ConfigError, match="train") as exc:
        load_model(exported, mtp_depths=4)
    assert "4" in str(exc.value) and "3" in str(exc.value)


def test_negative_depths(exported):
    with pytest.raises(ConfigError):
        load_model(exported, mtp_depths=-1)


def test_checkpoint_without_mtp(tmp_path, source_model):
    torch.manual_seed(0)
    plain = randomize_(InklingLM(tiny_config(), mtp_depths=0), seed=2)
    path = export_checkpoint(plain, tmp_path / "plain")
    raw = json.loads((path / "config.json").read_text())
    assert raw["mtp_config"]["num_nextn_predict_layers"] == 0
    model, _ = load_model(path)
    assert model.num_mtp_depths == 0
    assert_same_params(model, plain)
    with pytest.raises(ConfigError, match="train"):
        load_model(path, mtp_depths=1)


def test_tokenizer_path(exported, ckpt):
    assert open_checkpoint(exported).tokenizer_path == exported / "tokenizer.json"
    (ckpt / "tokenizer.json").unlink()
    model, ck = load_model(ckpt)
    assert ck.tokenizer_path is None
    assert model.num_mtp_depths == 3


def test_bf16_load_keeps_convs_and_router_bias_fp32(exported, source_model):
    model, _ = load_model(exported, dtype=torch.bfloat16)
    src = source_model.state_dict()
    fp32 = set()
    for name, m in model.named_modules():
        if isinstance(m, ShortConv):
            fp32.add(f"{name}.weight")
        elif isinstance(m, Router):
            fp32 |= {f"{name}.score_bias", f"{name}.global_scale"}
    assert any(n.endswith("score_bias") for n in fp32) and any(n.endswith("k_sconv.weight") for n in fp32)
    assert any(n.startswith("mtp.") for n in fp32)
    state = model.state_dict()
    for name, value in state.items():
        if name in fp32:
            assert value.dtype == torch.float32, name
            torch.testing.assert_close(value, src[name], rtol=0, atol=0, msg=name)
        else:
            assert value.dtype == torch.bfloat16, name
            torch.testing.assert_close(value, src[name].to(torch.bfloat16), rtol=0, atol=0, msg=name)
    ids = torch.randint(0, 90, (1, 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_errors_are_user_errors(tmp_path):
    """Every checkpoint problem is an InkfwError (printed as one sentence, no traceback)."""
    assert issubclass(CheckpointError, InkfwError) and issubclass(ConfigError, InkfwError)
    with pytest.raises(InkfwError):
        open_checkpoint(tmp_path / "missing")
