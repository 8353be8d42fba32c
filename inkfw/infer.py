"""Speculative decoding from the command line: the function behind ``scripts/infer.py``.

:func:`run_infer` builds the engine of ``conf/infer.yaml`` (:func:`~inkfw.speculative.build.build_engine`),
queues the prompts (``prompt``, ``prompt_token_ids``, ``prompts_file`` or a built-in demo),
generates with a progress bar, prints every request's output and a table of acceptance and
timing metrics, and optionally writes both as JSON (``output.json``).

Bad input of the run as a whole raises :class:`~inkfw.errors.InkfwError` (one line, exit 2 in
the script). In a ``prompts_file`` batch a bad request is rejected on its own: it gets
``error: request N: ...`` on stderr and ``finish_reason: "error"`` in the JSON, the others
still run, and the result's ``num_errors`` makes the script exit 2 after writing everything.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress
from rich.table import Table
from rich.text import Text

from inkfw.errors import ConfigError
from inkfw.presets import plain
from inkfw.speculative.build import build_engine, drafter_kind
from inkfw.speculative.engine import Engine, Request

DEMO_TEXT_PROMPTS = (  # the shipped checkpoint was trained on Python source
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    \"\"\"A first-in, first-out queue.\"\"\"\n\n    def __init__(self):\n",
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
def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(value: Any, what: str) -> list[int]:
    value = plain(value)
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) for t in value):
        raise ConfigError(f"{what} must be a list of integer token ids, got {value!r}.")
    return list(value)


def _stop_strings(value: Any) -> list[str]:
    value = plain(value)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ConfigError(f"stop must be a list of non-empty strings, got {value!r}.")
    return list(value)


def _max_new_tokens(value: Any, what: str = "max_new_tokens") -> int:
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{what} must be an integer >= 1, got {value!r}.")
    return value


def _output_path(cfg: Any) -> Path | None:
    """``output.json`` as a path whose folder exists (created), checked before any work."""
    out = cfg.get("output")
    value = out.get("json") if out is not None else None
    if value in (None, ""):
        return None
    path = Path(str(value)).expanduser()
    if path.is_dir():
        raise ConfigError(f"output.json={path} is a directory; give a file path.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output.json={path}: cannot create its folder ({exc.strerror or exc}).") from exc
    return path


# ------------------------------------------------------------------------ prompts
def read_prompts_file(path: str | Path) -> list[PromptItem]:
    """One :class:`PromptItem` per non-blank line; a bad line becomes an item with ``error``."""
    path = Path(str(path)).expanduser()
    if not path.is_file():
        raise ConfigError(f"prompts_file={path}: file not found." if not path.exists()
                          else f"prompts_file={path}: not a file.")
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
        return f"{where}: expected a JSON object like {{\"prompt\": \"...\"}} or {{\"token_ids\": [...]}}."
    unknown = [k for k in obj if k not in LINE_KEYS]
    if unknown:
        return f"{where}: unknown key {unknown[0]!r} (expected prompt or token_ids, and optionally max_new_tokens)."
    if ("prompt" in obj) == ("token_ids" in obj):
        return f"{where}: give exactly one of \"prompt\" (text) or \"token_ids\" (a list of ints)."
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            return f"{where}: \"prompt\" must be a string."
        item.text = obj["prompt"]
    else:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            return f"{where}: \"token_ids\" must be a list of integers."
        item.token_ids = ids
    if "max_new_tokens" in obj:
        n = obj["max_new_tokens"]
        if not _is_int(n) or n < 1:
            return f"{where}: \"max_new_tokens\" must be an integer >= 1, got {json.dumps(n)}."
        item.max_new_tokens = n
    return None


def _no_tokenizer_message(cfg: Any) -> str:
    name = cfg.model.get("name")
    return (f"prompt=\"...\" needs a tokenizer, but model {name!r} has no tokenizer.json; pass token ids instead, "
            f"with prompt_token_ids=[1,2,3] or prompts_file=PATH.jsonl holding {{\"token_ids\": [...]}} lines.")


def collect_prompts(cfg: Any) -> tuple[list[PromptItem], bool]:
    """(items, batch) from ``prompt`` / ``prompt_token_ids`` / ``prompts_file``; ``batch`` is
    True for a file (its bad requests are rejected one by one). No items: the demo."""
    given = [k for k in ("prompt", "prompt_token_ids", "prompts_file") if cfg.get(k) is not None]
    if len(given) > 1:
        raise ConfigError(f"give only one of prompt, prompt_token_ids or prompts_file, got {' and '.join(given)}.")
    if cfg.get("prompts_file") is not None:
        return read_prompts_file(cfg.prompts_file), True
    if cfg.get("prompt_token_ids") is not None:
        return [PromptItem(1, token_ids=_int_list(cfg.prompt_token_ids, "prompt_token_ids"))], False
    if cfg.get("prompt") is not None:
        return [PromptItem(1, text=str(cfg.prompt))], False
    return [], False


def demo_prompts(engine: Engine, tokenizer, seed: int) -> list[PromptItem]:
    """Short English prompts with a tokenizer, else seeded random-token prompts of a few lengths."""
    if tokenizer is not None:
        return [PromptItem(i + 1, text=t) for i, t in enumerate(DEMO_TEXT_PROMPTS)]
    g = torch.Generator().manual_seed(seed)
    hi = engine.model.cfg.logits_vocab_size
    room = engine.max_model_len - 1
    return [PromptItem(i + 1, token_ids=torch.randint(3, hi, (min(n, room),), generator=g).tolist())
            for i, n in enumerate(DEMO_PROMPT_LENGTHS)]


# ------------------------------------------------------------------------ the run
def run_infer(cfg: Any) -> dict[str, Any]:
    """Generate for the prompts of ``cfg`` and report; returns what ``output.json`` holds,
    plus ``num_errors`` (requests rejected or failed)."""
    console = Console()
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    max_new = _max_new_tokens(cfg.get("max_new_tokens", 64))
    stop = _stop_strings(cfg.get("stop"))
    seed = cfg.get("seed", 0)
    if not _is_int(seed) or seed < 0:
        raise ConfigError(f"seed must be an integer >= 0, got {seed!r}.")
    out_path = _output_path(cfg)
    items, batch = collect_prompts(cfg)
    torch.manual_seed(seed)

    engine, tokenizer = build_engine(cfg)
    if tokenizer is None:
        if stop:
            raise ConfigError(f"stop strings need a tokenizer, but model {cfg.model.get('name')!r} has no "
                              f"tokenizer.json; rely on EOS and max_new_tokens instead.")
        if not batch and items and items[0].text is not None:
            raise ConfigError(_no_tokenizer_message(cfg))
    if not items:
        items = demo_prompts(engine, tokenizer, seed)

    base = engine.sampler.defaults if hasattr(engine.sampler, "defaults") else None
    base_seed = base.seed if base is not None and base.seed is not None else seed
    requests: dict[int, Request] = {}
    for item in items:
        if item.error is None:
            try:
                ids = item.token_ids
                if ids is None:
                    if tokenizer is None:
                        raise ConfigError("\"prompt\" needs a tokenizer, but the model has none; "
                                          "give \"token_ids\" instead.")
                    ids = item.token_ids = tokenizer.encode(item.text).ids
                params = replace(base, seed=base_seed + item.index - 1) if base is not None else None
                requests[item.index] = engine.add_request(ids, params, max_new_tokens=item.max_new_tokens or max_new,
                                                          stop=stop)
            except ConfigError as exc:
                if not batch:
                    raise
                item.error = str(exc)
        if item.error is not None:
            err.print(f"error: request {item.index}: {item.error}", markup=False)

    reqs = list(requests.values())
    t0 = time.perf_counter()
    if reqs:
        with Progress(*Progress.get_default_columns(), MofNCompleteColumn(), console=console,
                      transient=True) as progress:
            task = progress.add_task("generating", total=sum(r.max_new_tokens for r in reqs))
            engine.generate(reqs, on_tokens=lambda n: progress.advance(task, n))
    wall = time.perf_counter() - t0

    for item in items:  # failures the engine found while running (e.g. a KV pool too small)
        r = requests.get(item.index)
        if r is not None and r.finish_reason == "error" and item.error is None:
            item.error = r.error or "the engine failed this request."
            err.print(f"error: request {item.index}: {item.error}", markup=False)

    result = {"requests": [_request_record(item, requests.get(item.index)) for item in items],
              "metrics": _metrics(cfg, engine, reqs, wall)}
    result["metrics"]["num_errors"] = sum(item.error is not None for item in items)
    _print_outputs(console, items, requests, tokenizer)
    console.print(_summary_table(cfg, engine, result["metrics"]))
    if out_path is not None:
        write_json_atomic(out_path, result)
        console.print(f"wrote {out_path}", markup=False, highlight=False)
    result["num_errors"] = result["metrics"]["num_errors"]
    return result


# ------------------------------------------------------------------------ reporting
def _ttft(r: Request | None) -> float | None:
    if r is None or r.first_token_time is None:
        return None
    return r.first_token_time - r.arrival_time


def _request_record(item: PromptItem, r: Request | None) -> dict[str, Any]:
    ok = r is not None and item.error is None
    return {
        "index": item.index,
        "prompt": item.text,
        "prompt_token_ids": list(r.prompt_token_ids) if r is not None else list(item.token_ids or []),
        "token_ids": list(r.output_token_ids) if r is not None else [],
        "text": r.text if r is not None else "",
        "num_verify_steps": r.num_verify_steps if r is not None else 0,
        "num_draft_tokens": r.num_draft_tokens if r is not None else 0,
        "num_accepted_tokens": r.num_accepted_tokens if r is not None else 0,
        "finish_reason": r.finish_reason if ok else "error",
        "error": item.error,
        "time_to_first_token_s": _ttft(r),
        "num_preemptions": r.num_preemptions if r is not None else 0,
    }


def _metrics(cfg: Any, engine: Engine, reqs: list[Request], wall: float) -> dict[str, Any]:
    m, t = engine.metrics, engine.times
    generated = sum(len(r.output_token_ids) for r in reqs)
    ttfts = [x for x in (_ttft(r) for r in reqs) if x is not None]
    total = t.total_s
    return {
        "drafter": drafter_kind(cfg.get("drafter")),
        "num_tokens": int(engine.drafter.num_tokens),
        "mtp_depths": int(engine.drafter.num_depths),
        "num_requests": len(reqs),
        "num_generated_tokens": generated,
        "num_verify_steps": m.num_steps,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "mean_acceptance_length": m.mean_acceptance_length,
        "acceptance_per_position": m.per_position_acceptance,
        "conditional_acceptance": m.conditional_acceptance,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "tokens_per_s": generated / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "time_to_first_token_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "step_times": {"draft_s": t.draft_s, "verify_s": t.verify_s, "bookkeeping_s": t.bookkeeping_s,
                       "forward_s": t.forward_s, "num_steps": t.num_steps},
        "forward_share": t.forward_s / total if total > 0 else 0.0,
    }


def _print_outputs(console: Console, items: list[PromptItem], requests: dict[int, Request], tokenizer) -> None:
    for item in items:
        r = requests.get(item.index)
        head = Text(f"request {item.index}", style="bold")
        if item.error is not None and (r is None or r.finish_reason == "error"):
            console.print(head + Text(f" rejected: {item.error}", style="red"))
            continue
        tau = 1 + r.num_accepted_tokens / r.num_verify_steps if r.num_verify_steps else 0.0
        head.append(f": {len(r.prompt_token_ids)} prompt + {len(r.output_token_ids)} new tokens ({r.finish_reason}), "
                    f"{r.num_verify_steps} steps, acceptance {tau:.2f}", style="dim")
        console.print(head)
        if tokenizer is not None:
            if item.text is not None:
                console.print(Text(item.text, style="cyan"), Text(r.text), sep="")
            else:
                console.print(Text(r.text))
        else:
            console.print(Text(f"ids: {r.output_token_ids}"))


def _pct(xs: list[float]) -> str:
    return " ".join(f"{100 * x:.1f}%" for x in xs) if xs else "-"


def _summary_table(cfg: Any, engine: Engine, m: dict[str, Any]) -> Table:
    table = Table(title="inkfw infer")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("model", str(cfg.model.get("path") or cfg.model.get("name")))
    sizes = f"k={m['num_tokens']}" + (f", D={m['mtp_depths']}" if m["mtp_depths"] else "")
    table.add_row("drafter", m["drafter"] + (f" ({sizes})" if m["num_tokens"] else ""))
    st = m["step_times"]
    total = st["draft_s"] + st["verify_s"] + st["bookkeeping_s"]

    def share(x: float) -> str:
        return f"{x:.3f} s ({100 * x / total:.0f}%)" if total > 0 else f"{x:.3f} s"

    rejected = m["num_errors"]
    table.add_row("requests", f"{m['num_requests']}" + (f" (+{rejected} rejected)" if rejected else ""))
    table.add_row("generated tokens", f"{m['num_generated_tokens']}")
    table.add_row("verify steps", f"{m['num_verify_steps']}")
    table.add_row("mean acceptance length", f"{m['mean_acceptance_length']:.3f}")
    table.add_row("per-position acceptance", _pct(m["acceptance_per_position"]))
    table.add_row("draft / accepted tokens",
                  f"{m['num_draft_tokens']} / {m['num_accepted_tokens']} ({100 * m['draft_acceptance_rate']:.1f}%)")
    table.add_row("tokens/s", f"{m['tokens_per_s']:.1f}")
    ttft = m["time_to_first_token_s"]
    table.add_row("mean time to first token", f"{ttft:.3f} s" if ttft is not None else "-")
    table.add_row("engine steps", f"{st['num_steps']}")
    table.add_row("step time: draft", share(st["draft_s"]))
    table.add_row("step time: verify", share(st["verify_s"]))
    table.add_row("step time: bookkeeping", share(st["bookkeeping_s"]))
    table.add_row("forward share", f"{100 * m['forward_share']:.0f}%")
    return table


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` via a temporary file in the same folder and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ConfigError(f"output.json={path}: cannot write ({exc.strerror or exc}).") from exc
        raise
    return path

