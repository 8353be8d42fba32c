"""Text data for training: documents, a deterministic split, tokenisation and packing.

Sources: text files, folders (recursively), ``.jsonl`` files with one ``{"text": ...}`` or
``{"prompt_token_ids": [...], "token_ids": [...]}`` (token ids, as ``scripts/generate_data.py``
writes them: used as they are, no tokenizer) per line, and ``stdlib``: the Python standard
library's own source files (tests excluded), a corpus that exists on every machine without a
download. :class:`HFDataModule` (``data=hf``) reads local jsonl / parquet / arrow files with a
``text`` or ``messages`` column through the ``datasets`` library instead.

Packing concatenates documents (each followed by EOS) into rows of ``seq_len`` tokens and
records every token's document index, so losses can refuse targets that cross a boundary.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from inkfw.checkpoint import read_tokenizer
from inkfw.errors import ConfigError
from inkfw.options import int_option, is_number, optional_int_option

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".jsonl", ".json", ".c", ".h", ".cfg", ".toml", ".yaml", ".yml"}
STDLIB = "stdlib"


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier (path, path:line): decides the split
    text: str = ""
    token_ids: tuple[int, ...] | None = None  # already tokenised (target-generated data): used as is

    @property
    def is_empty(self) -> bool:
        return not self.token_ids if self.token_ids is not None else not self.text.strip()


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without tests, site-packages or idlelib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "idlelib", "lib2to3"}
    files = []
    for p in sorted(root.rglob("*.py")):
        parts = set(p.relative_to(root).parts[:-1])
        if parts & skip or p.name.startswith("test_"):
            continue
        files.append(p)
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"data: cannot read {path}: {exc.strerror or exc}.") from exc


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _jsonl_documents(path: Path) -> Iterable[Document]:
    for i, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"data: {path} line {i} is not valid JSON ({exc.msg}).") from exc
        if isinstance(row, dict) and "token_ids" in row:  # scripts/generate_data.py: prompt + completion
            prompt, completion = row.get("prompt_token_ids", []), row["token_ids"]
            if not _is_id_list(prompt) or not _is_id_list(completion):
                raise ConfigError(
                    f'data: {path} line {i}: "prompt_token_ids" and "token_ids" must be lists of token ids >= 0.'
                )
            yield Document(f"{path}:{i}", token_ids=tuple(prompt + completion))
            continue
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ConfigError(
                f'data: {path} line {i} must be an object with a string field "text" '
                f'or a list of token ids "token_ids".'
            )
        yield Document(f"{path}:{i}", row["text"])


def source_list(value: Any, what: str) -> list[str]:
    """The ``sources`` option ``what`` as a list; one source given alone (``data.sources=stdlib``)
    counts as a list of one, not as a list of its characters."""
    value = list(value) if isinstance(value, Iterable) and not isinstance(value, (str, Path)) else value
    if isinstance(value, (str, Path)):
        return [str(value)]
    if isinstance(value, list) and all(isinstance(s, (str, Path)) for s in value):
        return [str(s) for s in value]
    raise ConfigError(f"{what} must be a list of files, folders, .jsonl files or 'stdlib', got {value!r}.")


def read_documents(sources: Sequence[str]) -> list[Document]:
    """Documents of every source, in a deterministic order."""
    if not sources:
        raise ConfigError("data: no sources given; set data.sources (files, folders, .jsonl, or 'stdlib').")
    docs: list[Document] = []
    for source in sources:
        if source == STDLIB:
            docs.extend(Document(f"stdlib/{p.name}:{i}", _read_text(p)) for i, p in enumerate(stdlib_files()))
            continue
        path = Path(source).expanduser()
        if not path.exists():
            raise ConfigError(f"data: source {source} does not exist.")
        files = (
            [path]
            if path.is_file()
            else sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        )
        for f in files:
            if f.suffix == ".jsonl":
                docs.extend(_jsonl_documents(f))
            else:
                docs.append(Document(str(f), _read_text(f)))
    docs = [d for d in docs if not d.is_empty]
    if not docs:
        raise ConfigError(f"data: the sources {list(sources)} hold no non-empty documents.")
    return docs


# ----------------------------------------------------------------------------- Hugging Face datasets
# file suffix -> the datasets library's builder for it
HF_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def hf_files(path: str | Path) -> list[tuple[str, Path]]:
    """(name, file) for ``path``: one jsonl / json / parquet / arrow file, or every jsonl /
    parquet / arrow file under a folder, sorted (a folder's ``.json`` files are metadata, as in
    what ``Dataset.save_to_disk`` writes). The name (the file's name, or its path inside the
    folder) names its documents, so the split does not depend on where the data lies."""
    root = Path(path).expanduser()
    if not root.exists():
        raise ConfigError(f"data.path {path} does not exist.")
    if root.is_file():
        if root.suffix not in HF_BUILDERS:
            raise ConfigError(f"data.path {path} is not a {' / '.join(sorted(HF_BUILDERS))} file.")
        return [(root.name, root)]
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in HF_BUILDERS and p.suffix != ".json")
    if not files:
        raise ConfigError(f"data.path {path} holds no .jsonl / .parquet / .arrow files.")
    return [(f.relative_to(root).as_posix(), f) for f in files]


def _load_hf_file(file: Path):
    """One local file as a ``datasets.Dataset``, never touching the network."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # read by datasets at import
    import datasets
    import datasets.config

    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True  # imported earlier: set it here
    try:
        return datasets.load_dataset(HF_BUILDERS[file.suffix], data_files=str(file), split="train")
    except Exception as exc:  # datasets and pyarrow raise many kinds on a bad file
        detail = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
        raise ConfigError(
            f"data: datasets cannot read {file} ({type(exc).__name__}{': ' + detail if detail else ''})."
        ) from exc


def messages_text(messages: Any, where: str) -> str:
    """A chat (list of ``{"role", "content"}``) as text in the server's plain template
    (:func:`inkfw.server.chat.plain_chat_prompt`: each message as ``"<role>: <content>\\n\\n"``),
    without the ``"assistant:"`` it adds to ask for a reply."""
    from inkfw.server.chat import PLAIN_ASSISTANT_PREFIX, plain_chat_prompt

    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ConfigError(f'data: {where}: "messages" must be a list of {{"role": str, "content": str}} objects.')
    return plain_chat_prompt(messages).removesuffix(PLAIN_ASSISTANT_PREFIX)


def read_hf_documents(path: str | Path) -> list[Document]:
    """Documents of local jsonl / parquet / arrow files (:func:`hf_files`) with a ``text`` column
    (a string per row) or else a ``messages`` column (a chat per row, as plain-template text);
    document names are ``<file name>:<row index>``."""
    docs: list[Document] = []
    for name, file in hf_files(path):
        table = _load_hf_file(file)
        columns = list(table.column_names)
        column = "text" if "text" in columns else "messages" if "messages" in columns else None
        if column is None:
            raise ConfigError(f'data: {file} has neither a "text" nor a "messages" column (columns: {columns}).')
        for row, value in enumerate(table[column]):
            where = f"{file} row {row}"
            if column == "messages":
                text = messages_text(value, where)
            elif value is None or isinstance(value, str):
                text = value or ""
            else:
                raise ConfigError(f'data: {where}: "text" must be a string, got {type(value).__name__}.')
            docs.append(Document(f"{name}:{row}", text))
    docs = [d for d in docs if not d.is_empty]
    if not docs:
        raise ConfigError(f"data: {path} holds no non-empty documents.")
    return docs


def is_validation(doc: Document, val_fraction: float, seed: int = 0) -> bool:
    """Deterministic split by a hash of the document's name (independent of order and size)."""
    digest = hashlib.blake2b(f"{seed}:{doc.name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def split_documents(
    docs: Sequence[Document], val_fraction: float, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    if not is_number(val_fraction) or not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction must lie in [0, 1), got {val_fraction!r}.")
    train, val = [], []
    for d in docs:
        (val if is_validation(d, val_fraction, seed) else train).append(d)
    if val_fraction > 0 and not val and len(train) > 1:
        val.append(train.pop())  # tiny corpora: keep at least one validation document
    return train, val


def pack(token_lists: Iterable[Sequence[int]], seq_len: int, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate documents (each + EOS) into rows of ``seq_len``: (input_ids [N, T], doc_ids [N, T]).

    The tail that does not fill a row is dropped; doc ids count documents from 0.
    """
    if seq_len < 2:
        raise ConfigError(f"data.seq_len must be >= 2, got {seq_len}.")
    ids, docs = [], []
    for i, tokens in enumerate(token_lists):
        ids.extend(tokens)
        ids.append(eos_id)
        docs.extend([i] * (len(tokens) + 1))
    rows = len(ids) // seq_len
    if rows == 0:
        return torch.zeros(0, seq_len, dtype=torch.long), torch.zeros(0, seq_len, dtype=torch.long)
    n = rows * seq_len
    return (
        torch.tensor(ids[:n], dtype=torch.long).view(rows, seq_len),
        torch.tensor(docs[:n], dtype=torch.long).view(rows, seq_len),
    )


def load_tokenizer(path: str | Path):
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` (one clear error if it is missing or unreadable)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"data: tokenizer file {path} does not exist.")
    return read_tokenizer(path)


def tokenize(tokenizer, docs: Sequence[Document]) -> list[list[int]]:
    """Token ids of every document: its ``token_ids`` when it has them, else its text encoded
    (``tokenizer`` may be None when every document has ids)."""
    texts = [d.text for d in docs if d.token_ids is None]
    if texts and tokenizer is None:
        raise ConfigError("data.tokenizer is not set; train one with scripts/train_tokenizer.py.")
    encoded = iter(e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)) if texts else iter(())
    return [list(d.token_ids) if d.token_ids is not None else next(encoded) for d in docs]


class ResumableLoader:
    """Batches of ``dataset`` in a seeded order per epoch, split over ranks; its state (epoch,
    batches served) goes into Lightning checkpoints, so a resumed run sees exactly the batches
    the uninterrupted run would have."""

    def __init__(
        self,
        dataset: TensorDataset,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0

    def __len__(self) -> int:
        return len(self.dataset) // self.world_size // self.batch_size

    def __iter__(self):
        n = len(self.dataset)
        order = (
            torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            if self.shuffle
            else torch.arange(n)
        )
        mine = order[self.rank : len(self) * self.batch_size * self.world_size : self.world_size]
        while self.position < len(self):
            rows = mine[self.position * self.batch_size : (self.position + 1) * self.batch_size]
            self.position += 1
            yield tuple(t[rows] for t in self.dataset.tensors)
        self.epoch, self.position = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class SplitDataModule(L.LightningDataModule):
    """What every training data node shares: ``train_set`` / ``val_set`` made by :meth:`setup`,
    served by a :class:`ResumableLoader` (seeded order, split over ranks, exact resume) and a
    plain validation loader. Subclasses set ``batch_size``, ``seed`` and ``num_workers`` through
    :meth:`set_loading`."""

    batch_size: int
    seed: int
    num_workers: int
    train_set: TensorDataset | None = None
    val_set: TensorDataset | None = None

    def set_loading(self, batch_size: int, seed: int, num_workers: int) -> None:
        """Check and keep the loaders' settings (``data.batch_size``, ``data.seed``, ``data.num_workers``)."""
        for name, value, least in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
            int_option(value, f"data.{name}", least)
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers

    def _split(self, name: str) -> TensorDataset:
        split = self.train_set if name == "train" else self.val_set
        if split is None:
            raise RuntimeError("setup() must run before the data loaders are asked for.")
        return split

    def train_dataloader(self) -> ResumableLoader:
        trainer = getattr(self, "trainer", None)
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        return ResumableLoader(self._split("train"), self.batch_size, self.seed, rank=rank, world_size=world)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._split("val"), batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


class TextDataModule(SplitDataModule):
    """Packed rows ``(input_ids [T], doc_ids [T])`` of a deterministic train/validation split.

    The ``inkfw/conf/data`` nodes target this class; ``scripts/train.py`` adds what the model decides
    (``eos_id``, ``vocab_size``) and the checkpoint's tokenizer when ``tokenizer`` is null.
    Nothing is read before :meth:`setup`.
    """

    def __init__(
        self,
        sources: Sequence[str],
        tokenizer: str | Path | None = None,
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.02,
        seed: int = 0,
        eos_id: int = 2,
        vocab_size: int | None = None,
        max_documents: int | None = None,
        num_workers: int = 0,
    ):
        super().__init__()
        self.sources, self.tokenizer_path = source_list(sources, "data.sources"), tokenizer
        self.set_loading(batch_size, seed, num_workers)
        self.seq_len, self.val_fraction = seq_len, val_fraction
        self.eos_id, self.vocab_size = eos_id, vocab_size
        self.max_documents = optional_int_option(max_documents, "data.max_documents")
        self.train_set = self.val_set = None
        self.val_documents: list[Document] = []

    def documents(self) -> list[Document]:
        """Every document of the source, in a deterministic order (subclasses read other sources)."""
        return read_documents(self.sources)

    def split(self) -> tuple[list[Document], list[Document]]:
        """(train, validation) documents: :meth:`documents`, at most ``max_documents``, split by name."""
        docs = self.documents()
        if self.max_documents:
            docs = docs[: self.max_documents]
        return split_documents(docs, self.val_fraction, self.seed)

    def tokenizer_for(self, docs: Sequence[Document] = ()):
        """The ``tokenizers.Tokenizer`` at ``tokenizer`` (checked against the model's vocabulary),
        or None when it is not set and every one of ``docs`` is already tokenised."""
        if self.tokenizer_path is None:
            if all(d.token_ids is not None for d in docs):
                return None
            raise ConfigError("data.tokenizer is not set; train one with scripts/train_tokenizer.py.")
        tokenizer = load_tokenizer(self.tokenizer_path)
        if self.vocab_size is not None and tokenizer.get_vocab_size() > self.vocab_size:
            raise ConfigError(
                f"data: the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's "
                f"vocabulary holds {self.vocab_size}; use the checkpoint's tokenizer.json."
            )
        return tokenizer

    def _token_lists(self, tokenizer, docs: Sequence[Document]) -> list[list[int]]:
        """Token ids per document; a pre-tokenised document loses a trailing EOS (packing adds one)
        and must fit the model's vocabulary."""
        lists = tokenize(tokenizer, docs)
        for d, ids in zip(docs, lists, strict=True):
            if d.token_ids is None:
                continue
            if ids and ids[-1] == self.eos_id:
                ids.pop()
            if self.vocab_size is not None and ids and max(ids) >= self.vocab_size:
                raise ConfigError(
                    f"data: {d.name} holds token id {max(ids)} but the model's vocabulary holds "
                    f"{self.vocab_size}; generate the data with this model."
                )
        return lists

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, val = self.split()
        tokenizer = self.tokenizer_for([*train, *val])
        self.val_documents = val
        sets = []
        for part in (train, val):
            ids, doc = pack(self._token_lists(tokenizer, part), self.seq_len, self.eos_id)
            sets.append(TensorDataset(ids, doc))
        self.train_set, self.val_set = sets
        if len(sets[0]) < 1:
            raise ConfigError(
                f"data: the training split holds fewer than {self.seq_len} tokens; add data or lower data.seq_len."
            )


class HFDataModule(TextDataModule):
    """``data=hf``: :class:`TextDataModule` over local jsonl / parquet / arrow files with a
    ``text`` or ``messages`` column, read through the ``datasets`` library without the network
    (:func:`read_hf_documents`). ``path``: one file or a folder of them."""

    def __init__(self, path: str | Path, **kwargs: Any):
        super().__init__(sources=[], **kwargs)
        self.path = path

    def documents(self) -> list[Document]:
        return read_hf_documents(self.path)


def heldout_prompts(
    sources: Sequence[str], val_fraction: float, seed: int, num_prompts: int, prompt_chars: int
) -> list[dict[str, str]]:
    """``{"prompt": text}`` rows cut from validation documents only (never seen in training):
    the first ``prompt_chars`` characters of the first ``num_prompts`` validation documents
    that are at least twice that long."""
    _, val = split_documents(read_documents(sources), val_fraction, seed)
    rows = [{"prompt": d.text[:prompt_chars]} for d in val if len(d.text) >= 2 * prompt_chars]
    if len(rows) < num_prompts:
        raise ConfigError(f"only {len(rows)} validation documents are long enough; lower num_prompts or prompt_chars.")
    return rows[:num_prompts]


def write_heldout_prompts(cfg) -> Path:
    """``scripts/heldout_prompts.py``: held-out prompts as JSON lines, from ``inkfw/conf/heldout_prompts.yaml``."""
    rows = heldout_prompts(
        source_list(cfg.sources, "sources"),
        cfg.val_fraction,
        int_option(cfg.seed, "seed", 0),
        int_option(cfg.num_prompts, "num_prompts"),
        int_option(cfg.prompt_chars, "prompt_chars"),
    )
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")
    return out
