"""MTP depths in a file of their own (``mtp.safetensors`` / ``model_mtp.safetensors``, as
Inkling-Small ships them): found beside the main file or index whether or not the index lists
them, only requested depths read, a depth in two files an error naming both, and the engine
serves such a checkpoint exactly like the single-file one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.engine import mtp, one_thread, spec_model  # noqa: F401  (one_thread: autouse fixture)
from inkfw.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from inkfw.errors import CheckpointError
from inkfw.models.inkling.checkpoint import export_checkpoint, load_model
from inkfw.speculative.factory import build_engine, serving_config

MTP_DEPTH = re.compile(r"^model\.mtp\.layers\.(\d+)\.")


@pytest.fixture(scope="module")
def source():
    return spec_model(seed=3)  # 4 MTP depths, chain norm


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp_file")
    return {
        "single": export_checkpoint(source, root / "single"),
        "split": export_checkpoint(source, root / "split", mtp_file=True),
    }


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _unlisted(split: Path, dst: Path) -> Path:
    """The split checkpoint with an index that does not list the MTP tensors."""
    path = _copy(split, dst)
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f != "mtp.safetensors"}
    (path / INDEX_FILE).write_text(json.dumps(index))
    return path


def _no_index(single: Path, dst: Path, side_name: str) -> Path:
    """model.safetensors without its MTP tensors, and the MTP tensors in ``side_name``; no index."""
    path = _copy(single, dst)
    tensors = load_file(str(path / SINGLE_FILE))
    side = {n: tensors.pop(n) for n in list(tensors) if n.startswith("model.mtp.")}
    save_file(tensors, str(path / SINGLE_FILE), metadata={"format": "pt"})
    save_file(side, str(path / side_name), metadata={"format": "pt"})
    return path


def _variants(exported, tmp_path) -> dict[str, Path]:
    return {
        "index lists them": exported["split"],
        "index does not list them": _unlisted(exported["split"], tmp_path / "unlisted"),
        "mtp.safetensors, no index": _no_index(exported["single"], tmp_path / "noindex", "mtp.safetensors"),
        "model_mtp.safetensors": _no_index(exported["single"], tmp_path / "model_mtp", "model_mtp.safetensors"),
    }


def _assert_same_params(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_separate_mtp_file_loads_every_depth(exported, source, tmp_path):
    for what, path in _variants(exported, tmp_path).items():
        model, ckpt = load_model(path)
        assert model.num_mtp_depths == 4, what
        assert len(ckpt.side_files) == 1 and ckpt.side_files[0].name.endswith("mtp.safetensors"), what
        assert all(ckpt.weight_map[n] == ckpt.side_files[0] for n in ckpt.weight_map if n.startswith("model.mtp.")), (
            what
        )
        _assert_same_params(model, source)


@pytest.fixture
def read_log(monkeypatch) -> list[str]:
    """Names of every tensor whose shape or data a load touches."""
    log: list[str] = []
    read, shape = Checkpoint.read, Checkpoint.shape
    monkeypatch.setattr(Checkpoint, "read", lambda self, name: log.append(name) or read(self, name))
    monkeypatch.setattr(Checkpoint, "shape", lambda self, name: log.append(name) or shape(self, name))
    return log


@pytest.mark.parametrize("depths", [0, 1, 3])
def test_only_requested_depths_are_read_from_the_mtp_file(exported, source, read_log, tmp_path, depths):
    for what, path in _variants(exported, tmp_path).items():
        read_log.clear()
        model, _ = load_model(path, mtp_depths=depths)
        read = {int(m.group(1)) for n in read_log if (m := MTP_DEPTH.match(n))}
        assert read == set(range(depths)), what
        assert ("model.mtp.chain_norm.weight" in read_log) == (depths > 0), what
        src = source.state_dict()
        assert all(torch.equal(v, src[k]) for k, v in model.state_dict().items()), what


def test_depth_in_the_main_file_and_the_mtp_file(exported, tmp_path):
    """One tensor of depth 1 moved from mtp.safetensors into model.safetensors: the depth is in two files."""
    path = _no_index(exported["single"], tmp_path / "both", "mtp.safetensors")
    side = load_file(str(path / "mtp.safetensors"))
    main = load_file(str(path / SINGLE_FILE))
    moved = "model.mtp.layers.1.transformer_block.attn.wq_du.weight"
    main[moved] = side.pop(moved)
    save_file(side, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    save_file(main, str(path / SINGLE_FILE), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="MTP depth 1") as exc:
        load_model(path, mtp_depths=1)
    assert str(path / SINGLE_FILE) in str(exc.value) and str(path / "mtp.safetensors") in str(exc.value)


def test_depth_in_both_mtp_files(exported, tmp_path):
    """mtp.safetensors and model_mtp.safetensors both hold depth 2 (same names)."""
    path = _no_index(exported["single"], tmp_path / "both", "mtp.safetensors")
    side = load_file(str(path / "mtp.safetensors"))
    save_file(
        {n: t for n, t in side.items() if n.startswith("model.mtp.layers.2.")}, str(path / "model_mtp.safetensors")
    )
    with pytest.raises(CheckpointError) as exc:
        load_model(path)
    assert str(path / "mtp.safetensors") in str(exc.value) and str(path / "model_mtp.safetensors") in str(exc.value)


def test_depth_in_both_mtp_files_under_other_names(exported, tmp_path):
    """Depth 0 in mtp.safetensors (release names) and in model_mtp.safetensors (HF names for its
    own norms and projection)."""
    path = _no_index(exported["single"], tmp_path / "both", "mtp.safetensors")
    side = load_file(str(path / "mtp.safetensors"))
    hf_names = {"hidden_norm": "hnorm", "embed_norm": "enorm", "input_proj": "eh_proj"}
    other = {f"model.mtp.layers.0.{hf_names[k]}.weight": side[f"model.mtp.layers.0.{k}.weight"] for k in hf_names}
    save_file(other, str(path / "model_mtp.safetensors"))
    with pytest.raises(CheckpointError, match="MTP depth 0") as exc:
        load_model(path)
    assert str(path / "mtp.safetensors") in str(exc.value) and str(path / "model_mtp.safetensors") in str(exc.value)


def test_missing_depth_tensor_names_the_mtp_file(exported, tmp_path):
    path = _no_index(exported["single"], tmp_path / "missing", "mtp.safetensors")
    side = load_file(str(path / "mtp.safetensors"))
    name = "model.mtp.layers.2.transformer_block.mlp.w13_dn.weight"
    del side[name]
    save_file(side, str(path / "mtp.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor") as exc:
        load_model(path)
    assert name in str(exc.value) and str(path / "mtp.safetensors") in str(exc.value)


SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints" / "inkling-tiny"  # trained depths
PROMPTS = Path(__file__).resolve().parent.parent / "benchmarks" / "prompts" / "stdlib-heldout.jsonl"


def _serve(path: Path, prompts: list[list[int]]):
    """Greedy outputs of an engine the serving factory builds from the checkpoint at ``path``
    (8 depths, k = 8), and its speculative metrics."""
    cfg = serving_config(
        [f"model.path={path}", *mtp(8, 8), "device=cpu", "engine.max_num_seqs=4", "engine.max_model_len=256"]
    )
    engine, _ = build_engine(cfg)
    assert engine.drafter.num_depths == 8
    reqs = [engine.add_request(p, max_new_tokens=24) for p in prompts]
    engine.generate(reqs)
    assert all(r.finished and r.error is None for r in reqs)
    return [r.output_token_ids for r in reqs], engine.metrics


def test_engine_serves_a_checkpoint_with_a_separate_mtp_file(tmp_path):
    """The shipped checkpoint re-exported with its 8 trained depths in mtp.safetensors (listed in
    the index, or in model_mtp.safetensors beside model.safetensors): greedy output and every
    acceptance count equal the single-file checkpoint's, and the depths are really served
    (drafts get accepted; without depths none would be)."""
    from inkfw.speculative.factory import load_tokenizer

    model, _ = load_model(SHIPPED)
    split = export_checkpoint(model, tmp_path / "split", mtp_file=True, tokenizer_json=SHIPPED / "tokenizer.json")
    plain = export_checkpoint(model, tmp_path / "plain", tokenizer_json=SHIPPED / "tokenizer.json")
    side = _no_index(plain, tmp_path / "model_mtp", "model_mtp.safetensors")
    tok = load_tokenizer({"path": str(SHIPPED)})
    prompts = [tok.encode(json.loads(line)["prompt"]).ids for line in PROMPTS.read_text().splitlines()[3:6]]
    want, want_metrics = _serve(plain, prompts)
    assert want_metrics.mean_acceptance_length > 1.5
    for path in (split, side):
        got, metrics = _serve(path, prompts)
        assert got == want, path
        assert metrics.accepted_per_position == want_metrics.accepted_per_position, path
        assert metrics.drafted_per_position == want_metrics.drafted_per_position, path
