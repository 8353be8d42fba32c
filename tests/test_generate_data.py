"""Target-generated data: scripts/generate_data.py continues training-split prompts through the
engine, and the jsonl it writes trains through TextDataModule as prompt + completion ids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from inkfw.errors import ConfigError
from inkfw.paths import config_dir
from inkfw.speculative.factory import build_engine, serving_config
from inkfw.speculative.sampling import SamplingParams
from inkfw.train.data import TextDataModule, load_tokenizer, read_documents, split_documents
from inkfw.train.generate import prompt_windows, run_generate_data
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


def _generate(corpus, out: Path, *extra: str) -> list[dict]:
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        cfg = compose("generate_data", overrides=_options(corpus, out, *extra))
    run_generate_data(cfg)
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
