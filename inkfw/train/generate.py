"""Target-generated training data (``scripts/generate_data.py``, ``inkfw/conf/generate_data.yaml``).

The target continues prompts cut from the training split of a data source (the ``data`` node,
split exactly as training splits it: validation documents never give a prompt) through the
speculative engine (:func:`~inkfw.speculative.factory.build_engine`: batched up to
``engine.max_num_seqs`` requests, MTP drafts by default, ``sampler.temperature`` as set). The
output is JSON lines ``{"prompt_token_ids": [...], "token_ids": [...], "document": name}``
(``token_ids``: the completion), written atomically; ``data=files data.sources=[that file]``
trains on prompt + completion ids, so MTP depths learn what the target produces.

With ``hidden_dir=DIR`` the same command also stores the target's final hidden states of every
generated sequence as a hidden-state dataset (:mod:`inkfw.train.hidden`: its shards and
``manifest.json``, written by :func:`~inkfw.train.hidden.dump_hidden_states`), which
``data=hidden data.path=DIR`` trains from. They are not taken from the engine's decoding pass:
its verify forwards see each sequence in fragments over the paged cache, with drafts that are
later rejected, and never run the last generated token. Instead, right after generation, the
dump's batched prefill (:func:`~inkfw.train.hidden.backbone_hidden`) runs over each finished
sequence from position 0: the exact states of those token ids. Rows (:func:`sequence_rows`):

* one sequence per row, exactly the jsonl line's ``prompt_token_ids + token_ids``, right-padded
  with EOS to the longest sequence (causal: padding changes no state before it);
* ``doc_ids``: the row's jsonl line index (line number - 1) on its tokens; padding position t
  gets ``-1 - t``, a document of its own, so no target lies in or reads from padding;
* the train/validation split is the one ``data=files data.sources=[out]`` gives the jsonl
  (its lines are named ``<out>:<line>``; ``data.val_fraction`` and ``data.seed`` of the prompt
  source), rows in jsonl order within each split.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.progress import MofNCompleteColumn, Progress

from inkfw.errors import ConfigError
from inkfw.nodes import build_node
from inkfw.options import int_option, optional_int_option
from inkfw.presets import parse_dtype, plain, resolve_path
from inkfw.reporting import output_file, write_text_atomic
from inkfw.speculative.factory import build_engine
from inkfw.train.data import Document, TextDataModule, split_documents, tokenize
from inkfw.train.hidden import MANIFEST, dump_hidden_states


@dataclass(frozen=True)
class Prompt:
    document: str  # name of the training document it was cut from
    token_ids: list[int]


def prompt_windows(token_ids: Sequence[int], prompt_tokens: int, stride: int | None = None) -> list[list[int]]:
    """Prompts of ``prompt_tokens`` tokens cut from one document: its first ``prompt_tokens``
    tokens (``stride`` None), or windows starting every ``stride`` tokens; none when the
    document is shorter than one prompt."""
    if len(token_ids) < prompt_tokens:
        return []
    starts = [0] if stride is None else range(0, len(token_ids) - prompt_tokens + 1, stride)
    return [list(token_ids[s : s + prompt_tokens]) for s in starts]


def cut_prompts(
    docs: Sequence[Document],
    tokenizer,
    num_prompts: int | None,
    prompt_tokens: int,
    stride: int | None = None,
    seed: int = 0,
) -> list[Prompt]:
    """``num_prompts`` prompts (None: all) from ``docs`` in a seeded order, windows of one
    document in order; documents are tokenised only as far as needed."""
    order = list(docs)
    random.Random(seed).shuffle(order)
    prompts: list[Prompt] = []
    for doc in order:
        for window in prompt_windows(tokenize(tokenizer, [doc])[0], prompt_tokens, stride):
            prompts.append(Prompt(doc.name, window))
            if num_prompts is not None and len(prompts) == num_prompts:
                return prompts
    if num_prompts is not None or not prompts:
        raise ConfigError(
            f"the training split holds {len(prompts)} prompt(s) of {prompt_tokens} tokens, "
            f"{num_prompts or 'at least 1'} asked; lower num_prompts or prompt_tokens, or set prompt_stride."
        )
    return prompts


def _tokenizer_path(cfg: Any) -> Path | None:
    """``data.tokenizer``, else the checkpoint's ``tokenizer.json``, else None."""
    if cfg.data.get("tokenizer"):
        return resolve_path(cfg.data.tokenizer)
    path = cfg.model.get("path")
    file = resolve_path(path) / "tokenizer.json" if path else None
    return file if file is not None and file.is_file() else None


@dataclass(frozen=True)
class HiddenDump:
    """The ``hidden_*`` options: where and how the generated sequences' hidden states are stored."""

    out_dir: Path
    batch_size: int  # sequences per prefill forward
    shard_size: int  # rows per shard file
    dtype: torch.dtype  # of the stored states


def hidden_dump_options(cfg: Any, out: Path) -> HiddenDump | None:
    """The ``hidden_*`` options checked before any work (None: ``hidden_dir`` not set)."""
    value = cfg.get("hidden_dir")
    if value in (None, ""):
        return None
    out_dir = Path(str(value)).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"hidden_dir={out_dir} is a file; give a folder for the shards and {MANIFEST}.")
    if out_dir.resolve() == out.resolve():
        raise ConfigError(f"hidden_dir and out are both {out}; give the hidden states a folder of their own.")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ConfigError(
            f"hidden_dir={out_dir} is not empty; give a new folder (it holds this run's sequences only) or empty it."
        )
    name = cfg.get("hidden_dtype")
    try:
        dtype = parse_dtype(str(name))
    except ConfigError as exc:
        raise ConfigError(f"hidden_dtype must be bfloat16, float32 or float16, got {name!r}.") from exc
    return HiddenDump(
        out_dir,
        int_option(cfg.get("hidden_batch_size"), "hidden_batch_size"),
        int_option(cfg.get("hidden_shard_size"), "hidden_shard_size"),
        dtype,
    )


def jsonl_split(out: Path, num_lines: int, val_fraction: float, seed: int) -> dict[str, list[int]]:
    """Line indices (line number - 1) of the jsonl at ``out`` per split, as ``data=files
    data.sources=[out]`` splits its lines (named ``<out>:<line number>``), in file order."""
    lines = [Document(f"{out}:{i + 1}", token_ids=(0,)) for i in range(num_lines)]  # only the names decide
    train, val = split_documents(lines, val_fraction, seed)
    index = {d.name: i for i, d in enumerate(lines)}
    return {"train": [index[d.name] for d in train], "val": [index[d.name] for d in val]}


def sequence_rows(
    sequences: Sequence[Sequence[int]], doc_ids: Sequence[int], seq_len: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence per row, right-padded with ``pad_id`` to ``seq_len``: (input_ids [N, T],
    doc_ids [N, T]). A row's tokens carry its doc id; padding position t carries ``-1 - t``, a
    document of its own, so no loss target lies in or reads from padding."""
    N = len(sequences)
    ids = torch.full((N, seq_len), pad_id, dtype=torch.long)  # [N, T]
    docs = (-1 - torch.arange(seq_len)).repeat(N, 1)  # [N, T]
    for r, (seq, doc) in enumerate(zip(sequences, doc_ids, strict=True)):
        ids[r, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        docs[r, : len(seq)] = doc
    return ids, docs


def run_generate_data(cfg: Any) -> dict[str, Any]:
    """Generate completions for prompts of the training split and write them (module docstring).
    Returns ``out``, ``num_prompts``, ``num_generated_tokens``, ``mean_acceptance_length``,
    ``tokens_per_s`` and ``wall_s``; with ``hidden_dir`` also ``hidden_dir``, ``hidden_rows``
    (rows per split) and ``hidden_wall_s``."""
    if str(cfg.data.get("_target_", "")).endswith(".HiddenDataModule"):
        raise ConfigError("data=hidden holds no text to cut prompts from; use data=stdlib|files|hf.")
    out = output_file(cfg.get("out"), "out")
    if out is None:
        raise ConfigError("out is not set; give the output file, e.g. out=runs/generated/data.jsonl.")
    hidden = hidden_dump_options(cfg, out)
    num_prompts = optional_int_option(cfg.get("num_prompts"), "num_prompts")
    prompt_tokens = int_option(cfg.get("prompt_tokens"), "prompt_tokens")
    stride = optional_int_option(cfg.get("prompt_stride"), "prompt_stride")
    max_new_tokens = int_option(cfg.get("max_new_tokens"), "max_new_tokens")
    seed = int_option(cfg.get("seed"), "seed", 0)
    torch.manual_seed(seed)

    engine, _ = build_engine(cfg)
    tokenizer_path = _tokenizer_path(cfg)
    data: TextDataModule = build_node(
        "data",
        cfg.data,
        tokenizer=tokenizer_path,
        eos_id=engine.model.cfg.eos_token_ids[0],
        vocab_size=engine.model.cfg.vocab_size,
    )
    train_docs, _ = data.split()  # the training split only: validation documents stay unseen
    prompts = cut_prompts(train_docs, data.tokenizer_for(train_docs), num_prompts, prompt_tokens, stride, seed)
    hidden_split = jsonl_split(out, len(prompts), data.val_fraction, data.seed) if hidden else {}
    if hidden and not hidden_split["train"]:
        raise ConfigError(
            f"hidden_dir: all {len(prompts)} generated sequence(s) would fall in the validation split "
            f"(data.val_fraction={data.val_fraction}); generate more prompts or lower data.val_fraction."
        )

    base = engine.sampler.defaults
    base_seed = base.seed if base.seed is not None else seed
    # all queued at once: the engine decodes engine.max_num_seqs of them together (docs/design.md §5)
    requests = [
        engine.add_request(p.token_ids, replace(base, seed=base_seed + i), max_new_tokens=max_new_tokens)
        for i, p in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    with Progress(*Progress.get_default_columns(), MofNCompleteColumn(), transient=True) as progress:
        task = progress.add_task("generating", total=len(requests) * max_new_tokens)
        engine.generate(requests, on_tokens=lambda n: progress.advance(task, n))
    wall = time.perf_counter() - t0
    for i, r in enumerate(requests):
        if r.finish_reason == "error":
            raise ConfigError(f"the engine failed prompt {i} ({r.error or 'no reason given'}).")

    lines = [
        json.dumps({"prompt_token_ids": p.token_ids, "token_ids": r.output_token_ids, "document": p.document})
        for p, r in zip(prompts, requests, strict=True)
    ]
    write_text_atomic(out, "".join(line + "\n" for line in lines), "out")
    generated = sum(len(r.output_token_ids) for r in requests)
    result = {
        "out": str(out),
        "num_prompts": len(requests),
        "num_generated_tokens": generated,
        "mean_acceptance_length": engine.metrics.mean_acceptance_length,
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "wall_s": wall,
    }
    print(
        f"wrote {len(requests)} completions ({generated} tokens in {wall:.1f} s, {result['tokens_per_s']:.1f} "
        f"tokens/s, mean acceptance length {result['mean_acceptance_length']:.2f}) to {out}"
    )
    if hidden is not None:
        sequences = [p.token_ids + list(r.output_token_ids) for p, r in zip(prompts, requests, strict=True)]
        result.update(dump_generated_hidden(cfg, engine.model, sequences, hidden_split, hidden, tokenizer_path, out))
    return result


def dump_generated_hidden(
    cfg: Any,
    model: Any,
    sequences: Sequence[Sequence[int]],
    split: dict[str, list[int]],
    hidden: HiddenDump,
    tokenizer_path: Path | None,
    out: Path,
) -> dict[str, Any]:
    """Store ``model``'s final hidden states of the finished ``sequences`` (jsonl line order) in
    ``hidden.out_dir`` through the dump's own writer: a batched prefill over each whole sequence
    (module docstring). Returns ``hidden_dir``, ``hidden_rows`` and ``hidden_wall_s``."""
    seq_len = max(len(s) for s in sequences)
    pad_id = int(model.cfg.eos_token_ids[0])
    splits = {
        name: sequence_rows([sequences[i] for i in lines], lines, seq_len, pad_id) for name, lines in split.items()
    }
    source = {
        "model": plain(cfg.model),
        "data": plain(cfg.data),
        "generated": {
            "jsonl": str(out),
            "rows": "one sequence per row: the jsonl line's prompt_token_ids + token_ids, right-padded with EOS",
            "doc_ids": "the jsonl line index (line number - 1); padding position t: -1 - t",
            "split": "as data=files data.sources=[jsonl] splits the lines, by data.val_fraction and data.seed",
            "sampler": plain(cfg.sampler),
            "max_new_tokens": int(cfg.max_new_tokens),
            "seed": int(cfg.seed),
        },
    }
    t0 = time.perf_counter()
    dumped = dump_hidden_states(
        model,
        splits,
        hidden.out_dir,
        tokenizer_file=tokenizer_path,
        batch_size=hidden.batch_size,
        shard_size=hidden.shard_size,
        dtype=hidden.dtype,
        source=source,
        progress=True,
    )
    wall = time.perf_counter() - t0
    rows = ", ".join(f"{name} {n}" for name, n in dumped.rows.items())
    print(
        f"wrote hidden states of every sequence ({rows} rows of {seq_len} tokens, {str(hidden.dtype).removeprefix('torch.')}, "
        f"a batched prefill in {wall:.1f} s) to {hidden.out_dir}: train with data=hidden data.path={hidden.out_dir}"
    )
    return {"hidden_dir": str(hidden.out_dir), "hidden_rows": dict(dumped.rows), "hidden_wall_s": wall}
