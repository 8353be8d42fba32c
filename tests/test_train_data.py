"""Training data: documents, deterministic split, packing with document ids."""

from __future__ import annotations

import json
import shutil

import pytest

from inkfw.errors import ConfigError
from inkfw.server.chat import plain_chat_prompt
from inkfw.train.data import (
    Document,
    HFDataModule,
    TextDataModule,
    pack,
    read_documents,
    read_hf_documents,
    source_list,
    split_documents,
    stdlib_files,
)
from inkfw.train.tokenizer import train_tokenizer


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


def test_one_source_given_alone_is_a_list_of_one(tmp_path):
    """``data.sources=stdlib`` was read as the sources s, t, d, l, i, b ("data: source s does not exist")."""
    assert source_list("stdlib", "data.sources") == ["stdlib"]
    assert source_list(tmp_path, "data.sources") == [str(tmp_path)]
    assert source_list(["stdlib", str(tmp_path)], "data.sources") == ["stdlib", str(tmp_path)]
    assert TextDataModule("stdlib").sources == ["stdlib"]
    for bad in (3, ["stdlib", 3]):
        with pytest.raises(ConfigError, match=r"^sources must be a list of files, folders, .jsonl files or 'stdlib'"):
            source_list(bad, "sources")
    with pytest.raises(ConfigError, match=r"^data.max_documents must be null or an integer >= 1, got -1\.$"):
        TextDataModule(["stdlib"], max_documents=-1)


def test_jsonl_token_ids_are_documents_without_a_tokenizer(tmp_path):
    rows = [
        {"prompt_token_ids": [5, 6], "token_ids": [7, 8, 2]},  # ends at EOS: packing adds its own
        {"prompt_token_ids": [9], "token_ids": [10, 11]},
        {"token_ids": [12, 13, 14]},
    ]
    path = tmp_path / "gen.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = read_documents([str(path)])
    assert [d.token_ids for d in docs] == [(5, 6, 7, 8, 2), (9, 10, 11), (12, 13, 14)]
    assert [d.name for d in docs] == [f"{path}:1", f"{path}:2", f"{path}:3"]
    data = TextDataModule([str(path)], tokenizer=None, seq_len=4, val_fraction=0.0, eos_id=2, vocab_size=16)
    data.setup("fit")
    assert data.train_set is not None
    assert data.train_set.tensors[0].tolist() == [[5, 6, 7, 8], [2, 9, 10, 11], [2, 12, 13, 14]]
    assert data.train_set.tensors[1].tolist() == [[0, 0, 0, 0], [0, 1, 1, 1], [1, 2, 2, 2]]
    # ids the model cannot embed, and malformed id lists, are one clear error
    small = TextDataModule([str(path)], tokenizer=None, seq_len=4, val_fraction=0.0, eos_id=2, vocab_size=12)
    with pytest.raises(ConfigError, match=r"gen.jsonl:3 holds token id 14 but the model's vocabulary holds 12"):
        small.setup("fit")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt_token_ids": [1], "token_ids": ["a"]}) + "\n")
    with pytest.raises(ConfigError, match="line 1: .*lists of token ids"):
        read_documents([str(tmp_path / "bad.jsonl")])
    # text documents still need a tokenizer
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    mixed = TextDataModule([str(path), str(tmp_path / "text.jsonl")], tokenizer=None, seq_len=4, val_fraction=0.0)
    with pytest.raises(ConfigError, match="data.tokenizer is not set"):
        mixed.setup("fit")


# ----------------------------------------------------------------------------- data=hf
CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A folder with text and messages columns in jsonl, parquet and arrow (datasets' save_to_disk)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("hf")
    texts = [f"def f{i}(x):\n    return x + {i}\n" for i in range(30)]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts[:20])))
    pq.write_table(pa.table({"text": texts[20:]}), root / "b.parquet")
    pq.write_table(pa.table({"messages": CHATS, "score": [1.0, 0.5]}), root / "chat.parquet")
    (root / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    datasets.Dataset.from_dict({"text": ["import os\n", "import sys\n"]}).save_to_disk(str(root / "saved"))
    tok = train_tokenizer([str(root / "a.jsonl")], vocab_size=300, out=root.parent / f"{root.name}-tokenizer.json")
    return root, tok


def test_hf_reads_text_and_messages_from_jsonl_parquet_and_arrow(hf_folder):
    root, _ = hf_folder
    docs = read_hf_documents(root)
    by_name = {d.name: d.text for d in docs}
    assert len(docs) == 20 + 10 + 2 + 2 + 2
    assert by_name["a.jsonl:3"] == "def f3(x):\n    return x + 3\n"
    assert by_name["b.parquet:0"] == "def f20(x):\n    return x + 20\n"
    assert by_name["saved/data-00000-of-00001.arrow:1"] == "import sys\n"
    # messages in the server's plain template, without the "assistant:" that asks for a reply
    expected = ["user: Hi\n\nassistant: Hello there.\n\n", "system: Be brief.\n\nuser: 2+2?\n\n"]
    assert [by_name[f"chat.parquet:{i}"] for i in range(2)] == expected
    assert [by_name[f"chat.jsonl:{i}"] for i in range(2)] == expected
    assert expected[0] + "assistant:" == plain_chat_prompt(CHATS[0])
    # one file: named by its file name alone
    assert [d.name for d in read_hf_documents(root / "b.parquet")][:2] == ["b.parquet:0", "b.parquet:1"]


def test_hf_split_is_deterministic_and_independent_of_the_folder(hf_folder, tmp_path):
    root, tok = hf_folder
    copy = tmp_path / "elsewhere"
    shutil.copytree(root, copy)
    splits = []
    for path in (root, root, copy):
        data = HFDataModule(path, tokenizer=tok, seq_len=8, val_fraction=0.3, eos_id=2, vocab_size=512)
        data.setup("fit")
        assert data.train_set is not None and len(data.train_set) > 0
        splits.append((sorted(d.name for d in data.split()[0]), sorted(d.name for d in data.val_documents)))
    assert splits[0] == splits[1] == splits[2]
    train, val = splits[0]
    assert val and not set(train) & set(val) and len(train) + len(val) == 36
    other = HFDataModule(root, tokenizer=tok, val_fraction=0.3, seed=1)
    assert sorted(d.name for d in other.split()[1]) != val


def test_hf_bad_input_is_one_sentence(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"], "n": [1]}), tmp_path / "t.parquet")
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n")
    (tmp_path / "notes.txt").write_text("x")
    cases = [
        (tmp_path / "missing", f"data.path {tmp_path / 'missing'} does not exist."),
        (
            tmp_path / "notes.txt",
            f"data.path {tmp_path / 'notes.txt'} is not a .arrow / .json / .jsonl / .parquet file.",
        ),
        (
            tmp_path / "t.parquet",
            f"data: {tmp_path / 't.parquet'} has neither a \"text\" nor a \"messages\" column (columns: ['body', 'n']).",
        ),
        (
            tmp_path / "m.jsonl",
            f'data: {tmp_path / "m.jsonl"} row 0: "messages" must be a list of {{"role": str, "content": str}} objects.',
        ),
    ]
    for path, message in cases:
        with pytest.raises(ConfigError) as info:
            HFDataModule(path, tokenizer=None).setup("fit")
        assert str(info.value) == message
        assert "\n" not in str(info.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="holds no .jsonl / .parquet / .arrow files"):
        read_hf_documents(empty)
