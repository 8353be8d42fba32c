"""Prompts of a generation run, and the per-request options checked with them.

A run's prompts come from at most one of ``prompt`` (text), ``prompt_token_ids`` or
``prompts_file`` (JSON lines), or else from a built-in demo. Each becomes a :class:`PromptItem`.
Bad input of the run as a whole raises :class:`~inkfw.errors.ConfigError`; a bad line of a
``prompts_file`` becomes an item with ``error`` set, so the other lines still run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from inkfw.errors import ConfigError
from inkfw.options import is_int
from inkfw.presets import plain

DEMO_TEXT_PROMPTS = (  # the shipped checkpoint was trained on Python source
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    'class Queue:\n    """A first-in, first-out queue."""\n\n    def __init__(self):\n',
)
DEMO_PROMPT_LENGTHS = (7, 19, 42)  # random-token demo prompts (tokenizer-less models)
LINE_KEYS = ("prompt", "token_ids", "max_new_tokens")


@dataclass
class PromptItem:
    """One request as given: text or ids (or why it is unusable), and its own length limit."""

    index: int  # 1-based, as printed in ``request N``
    text: str | None = None
    token_ids: list[int] | None = None
    max_new_tokens: int | None = None
    error: str | None = None


# ------------------------------------------------------------------------ options
def token_id_list(value: Any, what: str) -> list[int]:
    """``value`` as a list of ints, else a :class:`ConfigError` naming the option ``what``."""
    value = plain(value)
    if not isinstance(value, (list, tuple)) or not all(is_int(t) for t in value):
        raise ConfigError(f"{what} must be a list of integer token ids, got {value!r}.")
    return list(value)


def stop_strings(value: Any) -> list[str]:
    """The ``stop`` option: null, one string or a list of non-empty strings."""
    value = plain(value)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ConfigError(f"stop must be a list of non-empty strings, got {value!r}.")
    return list(value)


# ------------------------------------------------------------------------ prompts
def read_prompts_file(path: str | Path) -> list[PromptItem]:
    """One :class:`PromptItem` per non-blank line; a bad line becomes an item with ``error``."""
    path = Path(str(path)).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"prompts_file={path}: file not found." if not path.exists() else f"prompts_file={path}: not a file."
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"prompts_file={path}: cannot read it as UTF-8 text ({exc}).") from exc
    items: list[PromptItem] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        item = PromptItem(index=len(items) + 1)
        items.append(item)
        where = f"{path.name} line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            item.error = f"{where} is not valid JSON ({exc.msg} at column {exc.colno})."
            continue
        item.error = _parse_line(obj, item, where)
    if not items:
        raise ConfigError(f"prompts_file={path} holds no prompts (one JSON object per line).")
    return items


def _parse_line(obj: Any, item: PromptItem, where: str) -> str | None:
    """Fill ``item`` from one JSON line; the error sentence, or None when it is fine."""
    if not isinstance(obj, dict):
        return f'{where}: expected a JSON object like {{"prompt": "..."}} or {{"token_ids": [...]}}.'
    unknown = [k for k in obj if k not in LINE_KEYS]
    if unknown:
        return f"{where}: unknown key {unknown[0]!r} (expected prompt or token_ids, and optionally max_new_tokens)."
    if ("prompt" in obj) == ("token_ids" in obj):
        return f'{where}: give exactly one of "prompt" (text) or "token_ids" (a list of ints).'
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            return f'{where}: "prompt" must be a string.'
        item.text = obj["prompt"]
    else:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not all(is_int(t) for t in ids):
            return f'{where}: "token_ids" must be a list of integers.'
        item.token_ids = ids
    if "max_new_tokens" in obj:
        n = obj["max_new_tokens"]
        if not is_int(n) or n < 1:
            return f'{where}: "max_new_tokens" must be an integer >= 1, got {json.dumps(n)}.'
        item.max_new_tokens = n
    return None


def no_tokenizer_message(model_name: Any) -> str:
    """Why a text prompt cannot run on a model without ``tokenizer.json``, and what to give instead."""
    return (
        f'prompt="..." needs a tokenizer, but model {model_name!r} has no tokenizer.json; pass token ids '
        f'instead, with prompt_token_ids=[1,2,3] or prompts_file=PATH.jsonl holding {{"token_ids": [...]}} '
        f"lines."
    )


def collect_prompts(cfg: Any) -> tuple[list[PromptItem], bool]:
    """(items, batch) from ``prompt`` / ``prompt_token_ids`` / ``prompts_file``; ``batch`` is
    True for a file (its bad requests are rejected one by one). No items: the demo."""
    given = [k for k in ("prompt", "prompt_token_ids", "prompts_file") if cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"give only one of prompt, prompt_token_ids or prompts_file, got {' and '.join(given)}.")
    if cfg.get("prompts_file") is not None:
        return read_prompts_file(cfg.prompts_file), True
    if cfg.get("prompt_token_ids") is not None:
        return [PromptItem(1, token_ids=token_id_list(cfg.prompt_token_ids, "prompt_token_ids"))], False
    if cfg.get("prompt") is not None:
        return [PromptItem(1, text=str(cfg.prompt))], False
    return [], False


def demo_prompts(engine, tokenizer, seed: int) -> list[PromptItem]:
    """Short Python-source prompts with a tokenizer, else seeded random-token prompts of a few
    lengths (each fits ``engine.max_model_len`` with room for one new token)."""
    if tokenizer is not None:
        return [PromptItem(i + 1, text=t) for i, t in enumerate(DEMO_TEXT_PROMPTS)]
    g = torch.Generator().manual_seed(seed)
    hi = engine.model.cfg.logits_vocab_size
    room = engine.max_model_len - 1
    return [
        PromptItem(i + 1, token_ids=torch.randint(3, hi, (min(n, room),), generator=g).tolist())
        for i, n in enumerate(DEMO_PROMPT_LENGTHS)
    ]


def prompt_token_ids(item: PromptItem, tokenizer) -> list[int]:
    """``item``'s token ids, encoding its text (and keeping the ids on the item) when needed."""
    if item.token_ids is not None:
        return item.token_ids
    if tokenizer is None:
        raise ConfigError('"prompt" needs a tokenizer, but the model has none; give "token_ids" instead.')
    ids = item.token_ids = tokenizer.encode(item.text).ids
    return ids
