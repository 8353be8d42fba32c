"""Text data for training: documents, a deterministic split, tokenisation and packing.

Sources: text files, folders (recursively), ``.jsonl`` files with one ``{"text": ...}`` per line,
and ``stdlib``: the Python standard library's own source files (tests excluded), a corpus that
exists on every machine without a download.

Packing concatenates documents (each followed by EOS) into rows of ``seq_len`` tokens and
records every token's document index, so losses can refuse targets that cross a boundary.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from inkfw.checkpoint import read_tokenizer
from inkfw.errors import ConfigError

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst", ".jsonl", ".json", ".c", ".h", ".cfg", ".toml", ".yaml", ".yml"}
STDLIB = "stdlib"


@dataclass(frozen=True)
class Document:
    name: str  # stable identifier (path, path:line): decides the split
    text: str


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


def _jsonl_documents(path: Path) -> Iterable[Document]:
    for i, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"data: {path} line {i} is not valid JSON ({exc.msg}).") from exc
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ConfigError(f'data: {path} line {i} must be an object with a string field "text".')
        yield Document(f"{path}:{i}", row["text"])


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
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise ConfigError(f"data: the sources {list(sources)} hold no non-empty documents.")
    return docs


def is_validation(doc: Document, val_fraction: float, seed: int = 0) -> bool:
    """Deterministic split by a hash of the document's name (independent of order and size)."""
    digest = hashlib.blake2b(f"{seed}:{doc.name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < val_fraction


def split_documents(
    docs: Sequence[Document], val_fraction: float, seed: int = 0
) -> tuple[list[Document], list[Document]]:
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction must lie in [0, 1), got {val_fraction}.")
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
    return [e.ids for e in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)]


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


class TextDataModule(L.LightningDataModule):
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
        self.sources, self.tokenizer_path = list(sources), tokenizer
        self.seq_len, self.batch_size, self.val_fraction, self.seed = seq_len, batch_size, val_fraction, seed
        self.eos_id, self.vocab_size, self.max_documents = eos_id, vocab_size, max_documents
        self.num_workers = num_workers
        self.train_set = self.val_set = None
        self.val_documents: list[Document] = []

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.tokenizer_path is None:
            raise ConfigError("data.tokenizer is not set; train one with scripts/train_tokenizer.py.")
        tokenizer = load_tokenizer(self.tokenizer_path)
        if self.vocab_size is not None and tokenizer.get_vocab_size() > self.vocab_size:
            raise ConfigError(
                f"data: the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's "
                f"vocabulary holds {self.vocab_size}; use the checkpoint's tokenizer.json."
            )
        docs = read_documents(self.sources)
        if self.max_documents:
            docs = docs[: self.max_documents]
        train, val = split_documents(docs, self.val_fraction, self.seed)
        self.val_documents = val
        sets = []
        for part in (train, val):
            ids, doc = pack(tokenize(tokenizer, part), self.seq_len, self.eos_id)
            sets.append(TensorDataset(ids, doc))
        self.train_set, self.val_set = sets
        if len(self.train_set) < 1:
            raise ConfigError(
                f"data: the training split holds fewer than {self.seq_len} tokens; add data or lower data.seq_len."
            )

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
        list(cfg.sources), float(cfg.val_fraction), int(cfg.seed), int(cfg.num_prompts), int(cfg.prompt_chars)
    )
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")
    return out
