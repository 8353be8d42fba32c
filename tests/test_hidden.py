"""Hidden-state datasets (inkfw.train.hidden): training MTP depths from dumped backbone states
gives the losses of online training; the dump resumes, splits by rank, and a dump of another
model or tokenizer is refused."""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers

from helpers.models import randomize_, tiny_config
from inkfw.errors import ConfigError
from inkfw.models.inkling.checkpoint import export_checkpoint
from inkfw.models.inkling.model import InklingLM
from inkfw.nodes import build_node
from inkfw.paths import config_dir
from inkfw.train.hidden import (
    MANIFEST,
    HiddenDataModule,
    dump_hidden_states,
    dump_rank,
    plan_shards,
    run_dump_hidden,
)
from inkfw.train.run import run_train

WORDS = [f"w{i}" for i in range(60)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    """A corpus of random words, a word-level tokenizer (ids 0-2: <pad> <bos> <eos>) and a tiny
    random checkpoint (3 MTP depths) shipping that tokenizer."""
    root = tmp_path_factory.mktemp("hidden")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60))))
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<bos>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = root / "tokenizer.json"
    tok.save(str(tokenizer))
    other_tokenizer = root / "other-tokenizer.json"
    tok.add_tokens(["extra"])
    tok.save(str(other_tokenizer))
    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=3))
    ckpt = export_checkpoint(model, root / "ckpt", tokenizer_json=tokenizer)
    return {"root": root, "corpus": corpus, "tokenizer": tokenizer, "other_tokenizer": other_tokenizer, "ckpt": ckpt}


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(name, overrides=overrides)


def _logged(output_dir: Path) -> dict[str, list[float]]:
    """Every logged loss and per-depth metric (CE, KL, agreement), in step order, from the CSV logger."""
    rows = list(csv.DictReader((output_dir / "csv" / "version_0" / "metrics.csv").open()))
    rows.sort(key=lambda r: int(r["step"]))
    keys = [k for k in rows[0] if k.startswith(("train/", "val/")) and k not in ("train/tokens_per_s", "train/lr")]
    return {key: [float(r[key]) for r in rows if r.get(key)] for key in keys}


def test_training_from_dumped_states_gives_the_online_losses(setup):
    root, ckpt = setup["root"], setup["ckpt"]
    text_data = ["data=files", f"data.sources=[{setup['corpus']}]", "data.seq_len=16", "data.val_fraction=0.2"]
    dump = root / "dump"
    cfg = _compose(
        "dump_hidden",
        ["model=inkling", f"model.path={ckpt}", *text_data, f"output_dir={dump}", "dtype=float32"]
        + ["batch_size=3", "shard_size=4", "device=cpu"],
    )
    result = run_dump_hidden(cfg)
    manifest = json.loads((dump / MANIFEST).read_text())
    assert result.manifest == dump / MANIFEST and not result.skipped
    assert manifest["dtype"] == "float32" and manifest["seq_len"] == 16 and manifest["hidden_size"] == 32
    assert len(result.written) == sum(len(s["shards"]) for s in manifest["splits"].values()) > 2

    common = [
        "task=mtp",
        f"model.path={ckpt}",
        "mtp.depths=4",  # one more than ships, as a user adds depths
        "mtp.train_from=2",
        "loss.objective=kl",  # the teacher is the unembedding of the (stored) backbone states
        "data.batch_size=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "logger=csv",
        "callbacks.progress_bar=null",
        "callbacks.checkpoint=null",
        "eval.num_prompts=0",
        "export=false",
    ]
    online, stored = root / "online", root / "stored"
    run_train(_compose("train", [*common, *text_data, f"output_dir={online}"]))
    run_train(_compose("train", [*common, "data=hidden", f"data.path={dump}", f"output_dir={stored}"]))
    want, got = _logged(online), _logged(stored)
    assert len(want["train/loss"]) == 4 and len(want["val/loss"]) == 2 and "val/depth3/ce" in want
    assert len(set(want["train/depth3/ce"])) == 4  # different batches, and the depths train
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=1e-5, rel=0), key

    # task=pretrain cannot train from stored states: one sentence, when the data node is built
    bad = _compose("train", ["task=pretrain", f"model.path={ckpt}", "data=hidden", f"data.path={dump}"])
    with pytest.raises(ConfigError, match="task=pretrain trains the backbone"):
        build_node("data", bad.data, tokenizer=setup["tokenizer"], eos_id=2, vocab_size=96)
    # the dump reads text data, not its own output
    with pytest.raises(ConfigError, match="data=hidden is what"):
        run_dump_hidden(_compose("dump_hidden", ["data=hidden", f"data.path={dump}", f"output_dir={root}/x"]))


def _rows(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (n, 12), generator=g)  # [n, T]
    doc = torch.arange(n * 12).view(n, 12) // 7  # [n, T], documents crossing rows
    return ids, doc


def _model(seed: int = 0, **overrides) -> InklingLM:
    torch.manual_seed(seed)
    return randomize_(InklingLM(tiny_config(**overrides), mtp_depths=0))


def test_dump_holds_the_backbone_states_and_resumes(setup, tmp_path):
    model, splits = _model(), {"train": _rows(5), "val": _rows(2, seed=1)}
    kwargs: dict[str, Any] = dict(tokenizer_file=setup["tokenizer"], batch_size=2, shard_size=2, dtype=torch.float32)
    first = dump_hidden_states(model, splits, tmp_path, **kwargs)
    files = ["train-00000.safetensors", "train-00001.safetensors", "train-00002.safetensors", "val-00000.safetensors"]
    assert first.written == files and first.manifest is not None
    with torch.no_grad():
        want = model.eval()(splits["train"][0])  # [5, T, H], one forward
    shard = load_file(tmp_path / "train-00001.safetensors")
    assert torch.equal(shard["input_ids"], splits["train"][0][2:4]) and torch.equal(
        shard["doc_ids"], splits["train"][1][2:4]
    )
    torch.testing.assert_close(shard["hidden"], want[2:4], atol=1e-5, rtol=0)

    # an interrupted run: one shard missing (a temporary file left), no manifest
    before = {f: (tmp_path / f).stat().st_mtime_ns for f in files}
    (tmp_path / "train-00001.safetensors").unlink()
    (tmp_path / ".train-00001.safetensors.999.tmp").write_bytes(b"half")
    (tmp_path / MANIFEST).unlink()
    (tmp_path / "val-00000.safetensors").write_bytes(b"damaged")  # unreadable: written again
    again = dump_hidden_states(model, splits, tmp_path, **kwargs)
    assert again.written == ["train-00001.safetensors", "val-00000.safetensors"]
    assert again.skipped == ["train-00000.safetensors", "train-00002.safetensors"]
    assert all((tmp_path / f).stat().st_mtime_ns == before[f] for f in again.skipped)
    assert torch.equal(load_file(tmp_path / "train-00001.safetensors")["hidden"], shard["hidden"])
    assert (tmp_path / MANIFEST).is_file()

    # shards of another model (or other rows) in the folder are refused, not overwritten
    with pytest.raises(ConfigError, match="train-00000.safetensors was written by another dump .config_hash"):
        dump_hidden_states(_model(rms_norm_eps=1e-5), splits, tmp_path, **kwargs)
    other_rows = {"train": _rows(5, seed=3), "val": splits["val"]}
    with pytest.raises(ConfigError, match="another dump .input_ids_sha256"):
        dump_hidden_states(model, other_rows, tmp_path, **kwargs)


def test_ranks_split_the_shards_exactly_once(setup, tmp_path, monkeypatch):
    model, splits = _model(), {"train": _rows(7), "val": _rows(3, seed=1)}
    every = [s.file for s in plan_shards({"train": 7, "val": 3}, 2)]
    assert len(every) == 6
    written = []
    for rank in range(4):
        result = dump_hidden_states(
            model, splits, tmp_path, tokenizer_file=setup["tokenizer"], shard_size=2, rank=rank, world_size=4
        )
        written += result.written
        # the manifest appears only with the last rank's shards
        assert (result.manifest is not None) == (rank == 3) == (tmp_path / MANIFEST).is_file()
    assert sorted(written) == sorted(every) and len(written) == len(set(written))
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert [s["file"] for split in ("train", "val") for s in manifest["splits"][split]["shards"]] == every
    assert manifest["splits"]["train"]["rows"] == 7 and manifest["dtype"] == "bfloat16"

    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert dump_rank() == (2, 3)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError, match="RANK must lie in"):
        dump_rank()


def test_a_dump_of_another_model_or_tokenizer_is_refused(setup, tmp_path):
    model, splits = _model(), {"train": _rows(4), "val": _rows(1, seed=1)}
    dump_hidden_states(model, splits, tmp_path, tokenizer_file=setup["tokenizer"], shard_size=2)
    ok = HiddenDataModule(tmp_path, model=model.cfg, tokenizer=setup["tokenizer"], batch_size=2)
    ok.setup()
    ids, doc, hidden = next(iter(ok.train_dataloader()))
    assert ids.shape == doc.shape == (2, 12) and hidden.shape == (2, 12, 32) and hidden.dtype == torch.bfloat16

    other = HiddenDataModule(tmp_path, model=tiny_config(rms_norm_eps=1e-5), tokenizer=setup["tokenizer"])
    with pytest.raises(ConfigError, match=rf"data.path={tmp_path} holds hidden states of another model.*rms_norm_eps"):
        other.setup()
    other = HiddenDataModule(tmp_path, model=model.cfg, tokenizer=setup["other_tokenizer"])
    with pytest.raises(ConfigError, match=rf"data.path={tmp_path} was dumped with another tokenizer"):
        other.setup()
    with pytest.raises(ConfigError, match="task=pretrain"):
        HiddenDataModule(tmp_path, task="inkfw.train.tasks.PretrainTask")
    HiddenDataModule(tmp_path, task="inkfw.train.tasks.MtpTask")  # the one task that reads stored states
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(ConfigError, match="has no manifest.json"):
        HiddenDataModule(tmp_path, model=model.cfg).setup()
