"""Target-generated data: scripts/generate_data.py continues training-split prompts through the
engine, and the jsonl it writes trains through TextDataModule as prompt + completion ids; with
hidden_dir it also dumps the exact hidden states of every sequence for data=hidden."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from inkfw.errors import ConfigError
from inkfw.nodes import build_node
from inkfw.paths import config_dir
from inkfw.presets import build_model
from inkfw.speculative.factory import build_engine, serving_config
from inkfw.speculative.sampling import SamplingParams
from inkfw.train.data import TextDataModule, load_tokenizer, read_documents, split_documents
from inkfw.train.generate import (
    HiddenDump,
    dump_generated_hidden,
    prompt_windows,
    run_generate_data,
    sequence_rows,
)
from inkfw.train.hidden import MANIFEST, HiddenDataModule
from inkfw.train.losses import target_mask
from inkfw.train.tokenizer import train_tokenizer

ROOT = Path(__file__).resolve().parent.parent
VAL_FRACTION = 0.3
PROMPT_TOKENS = 8
MAX_NEW = 6


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(a folder of 12 small text documents, a BPE tokenizer.json trained on it that fits inkling-debug)."""
    tmp = tmp_path_factory.mktemp("gen")
    docs = tmp / "docs"
    docs.mkdir()
    for i in range(12):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {i + j} + {i * j}\n\n" for j in range(4))
        (docs / f"doc{i:02d}.py").write_text(body)
    tok = train_tokenizer([str(docs)], vocab_size=300, out=tmp / "tokenizer.json")
    return docs, tok


def _options(corpus, out: Path, *extra: str) -> list[str]:
    docs, tok = corpus
    return [
        "model=inkling-debug",
        "data=files",
        f"data.sources=[{docs}]",
        f"data.tokenizer={tok}",
        f"data.val_fraction={VAL_FRACTION}",
        f"prompt_tokens={PROMPT_TOKENS}",
        f"max_new_tokens={MAX_NEW}",
        "engine.max_num_seqs=3",  # more prompts than seats: the engine queues the rest
        "device=cpu",
        f"out={out}",
        *extra,
    ]


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(name, overrides=overrides)


def _generate(corpus, out: Path, *extra: str) -> list[dict]:
    run_generate_data(_compose("generate_data", _options(corpus, out, *extra)))
    return [json.loads(line) for line in out.read_text().splitlines()]


def _train_split(corpus):
    docs, tok = corpus
    return split_documents(read_documents([str(docs)]), VAL_FRACTION, seed=0), load_tokenizer(tok)


def test_prompts_come_from_training_documents_and_completions_are_the_targets_greedy_output(corpus, tmp_path):
    (train, val), tokenizer = _train_split(corpus)
    assert val and len(train) >= 4  # the split matters: some documents are held out
    out = tmp_path / "gen.jsonl"
    rows = _generate(corpus, out, f"num_prompts={len(train)}")  # one prompt per training document
    assert len(rows) == len(train)
    by_name = {d.name: d for d in train}
    assert {r["document"] for r in rows} == set(by_name)  # every training document, no validation one
    for r in rows:
        doc_ids = tokenizer.encode(by_name[r["document"]].text, add_special_tokens=False).ids
        assert r["prompt_token_ids"] == doc_ids[:PROMPT_TOKENS]
    # more prompts than the training split holds is refused, never filled from validation documents
    with pytest.raises(ConfigError, match="training split holds"):
        _generate(corpus, tmp_path / "more.jsonl", f"num_prompts={len(train) + 1}")
    assert not (tmp_path / "more.jsonl").exists()

    # the completions are plain greedy decoding of the target (MTP drafting is lossless)
    engine, _ = build_engine(serving_config(["model=inkling-debug", "drafter=none", "device=cpu"]))
    reference = [engine.add_request(r["prompt_token_ids"], SamplingParams(), max_new_tokens=MAX_NEW) for r in rows]
    engine.generate(reference)
    assert [r["token_ids"] for r in rows] == [q.output_token_ids for q in reference]
    assert all(len(r["token_ids"]) == MAX_NEW or r["token_ids"][-1] == 2 for r in rows)

    # the output trains as prompt + completion ids, without a tokenizer
    data = TextDataModule([str(out)], tokenizer=None, seq_len=8, batch_size=2, val_fraction=0.0, vocab_size=512)
    assert [list(d.token_ids or ()) for d in data.documents()] == [r["prompt_token_ids"] + r["token_ids"] for r in rows]
    data.setup("fit")
    assert data.train_set is not None
    packed = data.train_set.tensors[0].flatten().tolist()
    expected = []
    for r in rows:
        ids = r["prompt_token_ids"] + r["token_ids"]
        expected += (ids[:-1] if ids[-1] == 2 else ids) + [2]  # one EOS after each document
    assert packed == expected[: len(packed)] and 0 <= len(expected) - len(packed) < 8  # the tail is dropped


def test_windows_sampling_and_the_script(corpus, tmp_path):
    assert prompt_windows(list(range(10)), 4) == [[0, 1, 2, 3]]
    assert prompt_windows(list(range(10)), 4, stride=3) == [[0, 1, 2, 3], [3, 4, 5, 6], [6, 7, 8, 9]]
    assert prompt_windows(list(range(3)), 4) == []

    # windows: more prompts than documents; sampling at temperature 1 leaves greedy decoding
    (train, _), _ = _train_split(corpus)
    n = len(train) + 2
    greedy = _generate(corpus, tmp_path / "g.jsonl", f"num_prompts={n}", "prompt_stride=4")
    sampled = _generate(corpus, tmp_path / "s.jsonl", f"num_prompts={n}", "prompt_stride=4", "sampler.temperature=1.0")
    assert len(greedy) == n and len({r["document"] for r in greedy}) < n
    assert [r["prompt_token_ids"] for r in sampled] == [r["prompt_token_ids"] for r in greedy]
    assert [r["token_ids"] for r in sampled] != [r["token_ids"] for r in greedy]

    with pytest.raises(ConfigError, match="prompt_tokens must be an integer >= 1, got 0"):
        _generate(corpus, tmp_path / "bad.jsonl", "prompt_tokens=0")

    # the script: the same options write the same file
    out = tmp_path / "script.jsonl"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "generate_data.py"),
            *_options(corpus, out, f"num_prompts={n}", "prompt_stride=4", f"hydra.run.dir={tmp_path}/h"),
        ],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert out.read_text() == (tmp_path / "g.jsonl").read_text()
    assert f"wrote {n} completions" in r.stdout


def test_padded_rows_hold_exact_states_and_give_no_target_in_or_from_padding(tmp_path):
    ids, doc = sequence_rows([[5, 6, 7, 8, 9], [5, 6, 7]], [4, 1], seq_len=5, pad_id=2)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 2, 2]]
    assert doc.tolist() == [[4, 4, 4, 4, 4], [1, 1, 1, -4, -5]]
    for offset in (1, 2, 3):  # targets: positions whose target `offset` ahead is of the same sequence
        assert target_mask(doc, offset).sum(1).tolist() == [5 - offset, max(0, 3 - offset)]

    # sequences of several lengths, batched and padded: each row's states are its own sequence's
    cfg = _compose("generate_data", ["model=inkling-debug", "device=cpu"])
    model = build_model(cfg.model, mtp_depths=0, dtype="float32", device="cpu")
    g = torch.Generator().manual_seed(0)
    sequences = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (11, 4, 7, 1)]
    hidden = HiddenDump(tmp_path / "dump", batch_size=3, shard_size=2, dtype=torch.float32)
    result = dump_generated_hidden(cfg, model, sequences, {"train": [0, 1, 3], "val": [2]}, hidden, None, tmp_path)
    assert result["hidden_rows"] == {"train": 3, "val": 1}
    rows = {
        split: [load_file(tmp_path / "dump" / f"{split}-{i:05d}.safetensors") for i in range(n)]
        for split, n in (("train", 2), ("val", 1))
    }
    train = {k: torch.cat([s[k] for s in rows["train"]]) for k in ("input_ids", "doc_ids", "hidden")}
    assert train["input_ids"].shape == (3, 11) and train["doc_ids"][:, 0].tolist() == [0, 1, 3]
    for row, line in enumerate([0, 1, 3]):
        seq = sequences[line]
        with torch.no_grad():
            alone = model(torch.tensor([seq]))[0]  # [L, H]
        assert train["input_ids"][row, : len(seq)].tolist() == seq
        torch.testing.assert_close(train["hidden"][row, : len(seq)], alone, atol=1e-5, rtol=0)


def test_hidden_dir_dumps_the_exact_states_of_every_generated_sequence_for_data_hidden(corpus, tmp_path):
    docs, tok = corpus
    out, dump, n = tmp_path / "gen.jsonl", tmp_path / "hidden", 9
    hidden_options = [f"hidden_dir={dump}", "hidden_dtype=float32", "hidden_batch_size=4", "hidden_shard_size=3"]
    # sampled: completions may stop at EOS, so rows of several lengths share one padded width
    sampling = [f"num_prompts={n}", "prompt_stride=4", "sampler.temperature=1.0"]
    lines = _generate(corpus, out, *sampling, *hidden_options)
    sequences = [r["prompt_token_ids"] + r["token_ids"] for r in lines]
    assert len(lines) == n

    # the rows split as data=files splits the jsonl (lines named <out>:<line>), in file order
    train_docs, val_docs = TextDataModule([str(out)], val_fraction=VAL_FRACTION).split()
    want_lines = {
        name: [int(d.name.rsplit(":", 1)[1]) - 1 for d in part]
        for name, part in (("train", train_docs), ("val", val_docs))
    }
    assert want_lines["train"] and want_lines["val"]
    manifest = json.loads((dump / MANIFEST).read_text())
    T = max(len(s) for s in sequences)
    assert manifest["seq_len"] == T and manifest["dtype"] == "float32"
    assert {k: v["rows"] for k, v in manifest["splits"].items()} == {k: len(v) for k, v in want_lines.items()}

    # token ids: exactly each jsonl line's prompt + completion, then EOS padding; hidden states:
    # the target's forward over those ids alone (no padding, no batch), within 1e-5 in fp32
    cfg = _compose("generate_data", _options(corpus, out))
    model = build_model(cfg.model, mtp_depths=0, dtype="float32", device="cpu")
    for split, want in want_lines.items():
        files = [dump / s["file"] for s in manifest["splits"][split]["shards"]]
        shards = [load_file(f) for f in files]
        ids, doc, hidden = (torch.cat([s[k] for s in shards]) for k in ("input_ids", "doc_ids", "hidden"))
        assert doc[:, 0].tolist() == want  # doc id: the jsonl line index
        for row, line in enumerate(want):
            seq = sequences[line]
            L = len(seq)
            assert ids[row, :L].tolist() == seq and ids[row, L:].eq(2).all()
            assert doc[row, :L].eq(line).all() and doc[row, L:].tolist() == [-1 - t for t in range(L, T)]
            with torch.no_grad():
                alone = model(torch.tensor([seq]))[0]  # [L, H]
            torch.testing.assert_close(hidden[row, :L], alone, atol=1e-5, rtol=0)

    # data=hidden trains from it: the composed node builds, checks the model and tokenizer, and serves the rows
    train_cfg = _compose(
        "train", ["task=mtp", "model=inkling-debug", "data=hidden", f"data.path={dump}", "data.batch_size=1"]
    )
    data = build_node("data", train_cfg.data, tokenizer=tok, eos_id=2, vocab_size=model.cfg.vocab_size)
    assert isinstance(data, HiddenDataModule)
    data.setup("fit")
    assert data.train_set is not None and data.val_set is not None
    assert (len(data.train_set), len(data.val_set)) == (len(want_lines["train"]), len(want_lines["val"]))
    served = []
    for batch_ids, batch_doc, batch_hidden in data.train_dataloader():  # [1, T], [1, T], [1, T, H]
        line = int(batch_doc[0, 0])
        served.append(line)
        assert batch_hidden.shape == (1, T, model.cfg.hidden_size)
        assert batch_ids[0, : len(sequences[line])].tolist() == sequences[line]
    assert sorted(served) == sorted(want_lines["train"])

    # bad combinations: one sentence each, before any generation
    with pytest.raises(ConfigError, match="hidden_dir=.* is not empty"):
        _generate(corpus, tmp_path / "again.jsonl", *hidden_options)
    with pytest.raises(ConfigError, match="hidden_dtype must be bfloat16, float32 or float16, got 'int8'"):
        _generate(corpus, tmp_path / "x.jsonl", f"hidden_dir={tmp_path}/new", "hidden_dtype=int8")
    with pytest.raises(ConfigError, match="hidden_dir and out are both"):
        _generate(corpus, tmp_path / "y.jsonl", f"hidden_dir={tmp_path}/y.jsonl")
    with pytest.raises(ConfigError, match="data=hidden holds no text"):
        run_generate_data(_compose("generate_data", ["data=hidden", f"data.path={dump}", f"out={tmp_path}/z.jsonl"]))
    assert not any((tmp_path / f).exists() for f in ("again.jsonl", "x.jsonl", "y.jsonl", "z.jsonl", "new"))
