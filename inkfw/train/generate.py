"""Target-generated training data (``scripts/generate_data.py``, ``inkfw/conf/generate_data.yaml``).

The target continues prompts cut from the training split of a data source (the ``data`` node,
split exactly as training splits it: validation documents never give a prompt) through the
speculative engine (:func:`~inkfw.speculative.factory.build_engine`: batched up to
``engine.max_num_seqs`` requests, MTP drafts by default, ``sampler.temperature`` as set). The
output is JSON lines ``{"prompt_token_ids": [...], "token_ids": [...], "document": name}``
(``token_ids``: the completion), written atomically; ``data=files data.sources=[that file]``
trains on prompt + completion ids, so MTP depths learn what the target produces.

Not done here: dumping hidden states in the same pass (``scripts/dump_hidden.py`` dumps them
from a data source).
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
from inkfw.presets import resolve_path
from inkfw.reporting import output_file, write_text_atomic
from inkfw.speculative.factory import build_engine
from inkfw.train.data import Document, TextDataModule, tokenize


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


def _optional_int(cfg: Any, name: str, minimum: int) -> int | None:
    value = cfg.get(name)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise ConfigError(f"{name} must be null or an integer >= {minimum}, got {value!r}.")
    return value


def _int(cfg: Any, name: str, minimum: int) -> int:
    value = cfg.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}.")
    return value


def _tokenizer_path(cfg: Any) -> Path | None:
    """``data.tokenizer``, else the checkpoint's ``tokenizer.json``, else None."""
    if cfg.data.get("tokenizer"):
        return resolve_path(cfg.data.tokenizer)
    path = cfg.model.get("path")
    file = resolve_path(path) / "tokenizer.json" if path else None
    return file if file is not None and file.is_file() else None


def run_generate_data(cfg: Any) -> dict[str, Any]:
    """Generate completions for prompts of the training split and write them (module docstring).
    Returns ``out``, ``num_prompts``, ``num_generated_tokens``, ``mean_acceptance_length``,
    ``tokens_per_s`` and ``wall_s``."""
    out = output_file(cfg.get("out"), "out")
    if out is None:
        raise ConfigError("out is not set; give the output file, e.g. out=runs/generated/data.jsonl.")
    num_prompts = _optional_int(cfg, "num_prompts", 1)
    prompt_tokens = _int(cfg, "prompt_tokens", 1)
    stride = _optional_int(cfg, "prompt_stride", 1)
    max_new_tokens = _int(cfg, "max_new_tokens", 1)
    seed = _int(cfg, "seed", 0)
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
    return result
