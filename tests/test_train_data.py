"""Training data: documents, deterministic split, packing with document ids."""

from __future__ import annotations

import json

import pytest

from inkfw.errors import ConfigError
from inkfw.train.data import Document, pack, read_documents, split_documents, stdlib_files


def test_stdlib_corpus_exists_without_tests():
    files = stdlib_files()
    assert len(files) > 100
    assert not any("test" in p.parts[-2:-1] or p.name.startswith("test_") for p in files)
    assert any(p.name == "json" or p.parent.name == "json" for p in files)


def test_pack_rows_and_doc_ids():
    ids, docs = pack([[5, 6, 7], [8], [9, 10, 11, 12]], seq_len=4, eos_id=2)
    assert ids.tolist() == [[5, 6, 7, 2], [8, 2, 9, 10]]
    assert docs.tolist() == [[0, 0, 0, 0], [1, 1, 2, 2]]
    with pytest.raises(ConfigError):
        pack([[1]], seq_len=1, eos_id=2)


def test_split_is_deterministic_and_order_free():
    docs = [Document(f"d{i}", "x") for i in range(200)]
    train, val = split_documents(docs, 0.1, seed=0)
    train2, val2 = split_documents(list(reversed(docs)), 0.1, seed=0)
    assert {d.name for d in val} == {d.name for d in val2}
    assert not {d.name for d in val} & {d.name for d in train}
    assert 5 < len(val) < 40
    assert {d.name for d in split_documents(docs, 0.1, seed=1)[1]} != {d.name for d in val}


def test_read_sources(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.md").write_text("world")
    (sub / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    docs = read_documents([str(tmp_path)])
    assert [d.text for d in docs] == ["hello", "one", "two", "world"]
    with pytest.raises(ConfigError, match="does not exist"):
        read_documents([str(tmp_path / "missing")])
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(ConfigError, match="line 1"):
        read_documents([str(tmp_path / "bad.jsonl")])
