"""Train a byte-level BPE ``tokenizer.json`` on a corpus (``scripts/train_tokenizer.py``).

Ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``, matching Inkling configs' pad/bos/eos ids.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inkfw.errors import ConfigError
from inkfw.options import is_int, optional_int_option
from inkfw.train.data import read_documents, source_list

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]


def train_tokenizer(sources: list[str], vocab_size: int, out: str | Path, max_documents: int | None = None) -> Path:
    if not is_int(vocab_size) or vocab_size < 260:
        raise ConfigError(f"vocab_size must be an integer >= 260 (256 bytes + special tokens), got {vocab_size!r}.")
    docs = read_documents(sources)[:max_documents]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


def run_train_tokenizer(cfg) -> Path:
    """``scripts/train_tokenizer.py``: train and save, from ``inkfw/conf/train_tokenizer.yaml``."""
    sources = source_list(cfg.sources, "sources")
    max_documents = optional_int_option(cfg.max_documents, "max_documents")
    out = train_tokenizer(sources, cfg.vocab_size, cfg.out, max_documents)
    print(f"wrote {out}")
    return out
