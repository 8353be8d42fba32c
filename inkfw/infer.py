"""Speculative decoding from the command line: the run behind ``scripts/infer.py``.

:func:`run_infer` builds the engine of ``inkfw/conf/infer.yaml``
(:func:`~inkfw.speculative.factory.build_engine`), queues the prompts (:mod:`inkfw.prompts`:
``prompt``, ``prompt_token_ids``, ``prompts_file`` or a built-in demo), generates with a
progress bar, and reports (:mod:`inkfw.reporting`): every request's output, a table of
acceptance and timing metrics, and optionally both as JSON (``output.json``).

Bad input of the run as a whole raises :class:`~inkfw.errors.InkfwError` (one line, exit 2 in
the script). In a ``prompts_file`` batch a bad request is rejected on its own: it gets
``error: request N: ...`` on stderr and ``finish_reason: "error"`` in the JSON, the others
still run, and the result's ``num_errors`` makes the script exit 2 after writing everything.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch
from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress

from inkfw.errors import ConfigError
from inkfw.options import int_option
from inkfw.prompts import (
    collect_prompts,
    demo_prompts,
    no_tokenizer_message,
    prompt_token_ids,
    stop_strings,
)
from inkfw.reporting import (
    infer_table,
    output_file,
    print_requests,
    request_record,
    run_metrics,
    write_json_atomic,
)
from inkfw.speculative.engine import Request
from inkfw.speculative.factory import build_engine, drafter_kind


def run_infer(cfg: Any) -> dict[str, Any]:
    """Generate for the prompts of ``cfg`` and report; returns what ``output.json`` holds,
    plus ``num_errors`` (requests rejected or failed)."""
    console = Console()
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    max_new = int_option(cfg.get("max_new_tokens", 64), "max_new_tokens")
    stop = stop_strings(cfg.get("stop"))
    seed = int_option(cfg.get("seed", 0), "seed", 0)
    out = cfg.get("output")
    out_path = output_file(out.get("json") if out is not None else None, "output.json")
    items, batch = collect_prompts(cfg)
    torch.manual_seed(seed)

    engine, tokenizer = build_engine(cfg)
    if tokenizer is None:
        if stop:
            raise ConfigError(
                f"stop strings need a tokenizer, but model {cfg.model.get('name')!r} has no "
                f"tokenizer.json; rely on EOS and max_new_tokens instead."
            )
        if not batch and items and items[0].text is not None:
            raise ConfigError(no_tokenizer_message(cfg.model.get("name")))
    if not items:
        items = demo_prompts(engine, tokenizer, seed)

    if engine.adaptive is not None:  # spec.num_tokens=auto chooses by step costs measured here
        with console.status("adaptive k: measuring step costs (warm-up, not in tokens/s)"):
            engine.warmup(range(1, min(max(1, len(items)), engine.config.max_num_seqs) + 1))

    base = engine.sampler.defaults
    base_seed = base.seed if base.seed is not None else seed
    requests: dict[int, Request] = {}
    for item in items:
        if item.error is None:
            try:
                ids = prompt_token_ids(item, tokenizer)
                params = replace(base, seed=base_seed + item.index - 1)
                requests[item.index] = engine.add_request(
                    ids, params, max_new_tokens=item.max_new_tokens or max_new, stop=stop
                )
            except ConfigError as exc:
                if not batch:
                    raise
                item.error = str(exc)
        if item.error is not None:
            err.print(f"error: request {item.index}: {item.error}", markup=False)

    reqs = list(requests.values())
    t0, warmup_s = time.perf_counter(), engine.warmup_s
    if reqs:
        with Progress(
            *Progress.get_default_columns(), MofNCompleteColumn(), console=console, transient=True
        ) as progress:
            task = progress.add_task("generating", total=sum(r.max_new_tokens for r in reqs))
            engine.generate(reqs, on_tokens=lambda n: progress.advance(task, n))
    wall = time.perf_counter() - t0 - (engine.warmup_s - warmup_s)  # first compiles / captures of a shape

    for item in items:  # failures the engine found while running (e.g. a KV pool too small)
        r = requests.get(item.index)
        if r is not None and r.finish_reason == "error" and item.error is None:
            item.error = r.error or "the engine failed this request."
            err.print(f"error: request {item.index}: {item.error}", markup=False)

    records = [
        request_record(
            requests.get(item.index), item.index, prompt=item.text, prompt_token_ids=item.token_ids, error=item.error
        )
        for item in items
    ]
    metrics = run_metrics(engine, reqs, wall, drafter_kind(cfg.get("drafter")))
    metrics["num_errors"] = sum(item.error is not None for item in items)
    result = {"requests": records, "metrics": metrics}
    print_requests(console, records, show_text=tokenizer is not None)
    console.print(infer_table(metrics, str(cfg.model.get("path") or cfg.model.get("name"))))
    if out_path is not None:
        write_json_atomic(out_path, result, "output.json")
        console.print(f"wrote {out_path}", markup=False, highlight=False)
    result["num_errors"] = metrics["num_errors"]
    return result
