"""Reporting of runs: statistics collected from engine state, and their renderings.

Two halves, kept apart (docs/design.md §6 defines the metrics):

* **statistics**: plain dicts collected from an engine's state after a run:
  :func:`request_record` (one request of ``output.json``) and :func:`run_metrics` (the run's
  :class:`~inkfw.speculative.metrics.SpecMetrics` and
  :class:`~inkfw.speculative.engine.StepTimes`, with throughput). The benchmark's per
  configuration results are collected by :mod:`inkfw.bench.timing`.
* **renderings** of those dicts: rich tables (:func:`infer_table`, :func:`bench_table`,
  :func:`overhead_table`, :func:`kernel_table`), the per-request listing
  (:func:`print_requests`), Markdown (:func:`bench_markdown`, :func:`kernel_markdown`), PNG
  plots (:func:`bench_plot`, :func:`bench_acceptance_plot`, :func:`overhead_plot`) and atomic
  JSON / text files (:func:`write_json_atomic`).

Used by ``scripts/infer.py`` (:mod:`inkfw.infer`) and ``scripts/bench.py`` (:mod:`inkfw.bench`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from inkfw.errors import ConfigError
from inkfw.speculative.engine import Request, StepTimes

OVERHEAD_TARGET = 1.15  # engine step time / forward time the benchmark aims below


# ============================================================================ statistics
def time_to_first_token(r: Request | None) -> float | None:
    """Seconds from ``r``'s arrival to its first output token (None before that)."""
    if r is None or r.first_token_time is None:
        return None
    return r.first_token_time - r.arrival_time


def request_record(
    r: Request | None,
    index: int,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """One entry of ``output.json``'s ``requests``.

    ``r`` is None for a request rejected before it reached the engine; then
    ``prompt_token_ids`` (when known) stands for its prompt. A request with ``error`` is
    reported with ``finish_reason: "error"``.
    """
    return {
        "index": index,
        "prompt": prompt,
        "prompt_token_ids": list(r.prompt_token_ids) if r is not None else list(prompt_token_ids or []),
        "token_ids": list(r.output_token_ids) if r is not None else [],
        "text": r.text if r is not None else "",
        "num_verify_steps": r.num_verify_steps if r is not None else 0,
        "num_draft_tokens": r.num_draft_tokens if r is not None else 0,
        "num_accepted_tokens": r.num_accepted_tokens if r is not None else 0,
        "finish_reason": r.finish_reason if r is not None and error is None else "error",
        "error": error,
        "time_to_first_token_s": time_to_first_token(r),
        "num_preemptions": r.num_preemptions if r is not None else 0,
    }


def step_times_record(t: StepTimes) -> dict[str, Any]:
    return {
        "draft_s": t.draft_s,
        "verify_s": t.verify_s,
        "bookkeeping_s": t.bookkeeping_s,
        "forward_s": t.forward_s,
        "num_steps": t.num_steps,
        "prompt_steps": t.prompt_steps,
        "prompt_s": t.prompt_s,
    }


def run_metrics(engine, requests: Sequence[Request], wall_s: float, drafter: str) -> dict[str, Any]:
    """``output.json``'s ``metrics`` for ``requests`` run on ``engine`` in ``wall_s`` seconds.

    Acceptance comes from ``engine.metrics`` and step timing from ``engine.times`` (both cover
    everything the engine ran since they were last reset); ``drafter`` names the drafter.
    """
    m, t = engine.metrics, engine.times
    generated = sum(len(r.output_token_ids) for r in requests)
    ttfts = [x for x in (time_to_first_token(r) for r in requests) if x is not None]
    total = t.total_s
    return {
        "drafter": drafter,
        "num_tokens": int(engine.drafter.num_tokens),
        "mtp_depths": int(engine.drafter.num_depths),
        "num_requests": len(requests),
        "num_generated_tokens": generated,
        "num_verify_steps": m.num_steps,
        "num_draft_tokens": m.num_draft_tokens,
        "num_accepted_tokens": m.num_accepted_tokens,
        "mean_acceptance_length": m.mean_acceptance_length,
        "acceptance_per_position": m.per_position_acceptance,
        "conditional_acceptance": m.conditional_acceptance,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "time_to_first_token_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "step_times": step_times_record(t),
        "forward_share": t.forward_s / total if total > 0 else 0.0,
        "warmup_s": float(engine.warmup_s),  # Engine.warmup: compile, capture, adaptive k's costs
        "chosen_k": counts_json(engine.k_chosen) if engine.adaptive is not None else None,
        # MTP depths each admitted request drafted with (0: plainly), where adaptive k chose them
        "depths_admitted": counts_json(engine.depths_admitted) if engine.adaptive is not None else None,
    }


def counts_json(counter: Mapping[int, int]) -> dict[str, int]:
    """A counter as JSON: string keys, in order of the keys."""
    return {str(k): n for k, n in sorted(counter.items())}


# ============================================================================ renderings
def print_requests(console: Console, records: Sequence[dict[str, Any]], show_text: bool) -> None:
    """Each request of ``records`` (:func:`request_record`): a header line, then its prompt and
    output text (``show_text``: the model has a tokenizer) or its output ids."""
    for rec in records:
        head = Text(f"request {rec['index']}", style="bold")
        if rec["error"] is not None:
            console.print(head + Text(f" rejected: {rec['error']}", style="red"))
            continue
        steps = rec["num_verify_steps"]
        tau = 1 + rec["num_accepted_tokens"] / steps if steps else 0.0
        head.append(
            f": {len(rec['prompt_token_ids'])} prompt + {len(rec['token_ids'])} new tokens "
            f"({rec['finish_reason']}), {steps} steps, acceptance {tau:.2f}",
            style="dim",
        )
        console.print(head)
        if show_text:
            if rec["prompt"] is not None:
                console.print(Text(rec["prompt"], style="cyan"), Text(rec["text"]), sep="")
            else:
                console.print(Text(rec["text"]))
        else:
            console.print(Text(f"ids: {rec['token_ids']}"))


def _percentages(xs: Sequence[float]) -> str:
    return " ".join(f"{100 * x:.1f}%" for x in xs) if xs else "-"


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def infer_table(metrics: dict[str, Any], model: str, title: str = "inkfw infer") -> Table:
    """The run's acceptance and timing (:func:`run_metrics` plus ``num_errors``) as a table."""
    m = metrics
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("model", model)
    sizes = f"k={m['num_tokens']}" + (f", D={m['mtp_depths']}" if m["mtp_depths"] else "")
    table.add_row("drafter", m["drafter"] + (f" ({sizes})" if m["num_tokens"] else ""))
    st = m["step_times"]
    total = st["draft_s"] + st["verify_s"] + st["bookkeeping_s"]

    def share(x: float) -> str:
        return f"{x:.3f} s ({100 * x / total:.0f}%)" if total > 0 else f"{x:.3f} s"

    rejected = m.get("num_errors", 0)
    table.add_row("requests", f"{m['num_requests']}" + (f" (+{rejected} rejected)" if rejected else ""))
    table.add_row("generated tokens", f"{m['num_generated_tokens']}")
    table.add_row("verify steps", f"{m['num_verify_steps']}")
    table.add_row("mean acceptance length", f"{m['mean_acceptance_length']:.3f}")
    table.add_row("per-position acceptance", _percentages(m["acceptance_per_position"]))
    table.add_row(
        "draft / accepted tokens",
        f"{m['num_draft_tokens']} / {m['num_accepted_tokens']} ({100 * m['draft_acceptance_rate']:.1f}%)",
    )
    table.add_row("tokens/s", f"{m['tokens_per_s']:.1f}")
    ttft = m["time_to_first_token_s"]
    table.add_row("mean time to first token", f"{ttft:.3f} s" if ttft is not None else "-")
    table.add_row("engine steps", f"{st['num_steps']}")
    decode_steps = st["num_steps"] - st["prompt_steps"]
    if decode_steps:
        table.add_row(
            "mean decode step", f"{1e3 * (total - st['prompt_s']) / decode_steps:.2f} ms ({_steps(decode_steps)})"
        )
    if st["prompt_steps"]:
        table.add_row("steps with prompt chunks", f"{st['prompt_s']:.3f} s ({_steps(st['prompt_steps'])})")
    table.add_row("step time: draft", share(st["draft_s"]))
    table.add_row("step time: verify", share(st["verify_s"]))
    table.add_row("step time: bookkeeping", share(st["bookkeeping_s"]))
    table.add_row("forward share", f"{100 * m['forward_share']:.0f}%")
    if m.get("chosen_k") is not None:  # spec.num_tokens=auto
        table.add_row("k chosen (rounds)", " ".join(f"{k}:{n}" for k, n in m["chosen_k"].items()) or "-")
    if m.get("depths_admitted"):
        table.add_row("depths (requests)", " ".join(f"{d}:{n}" for d, n in m["depths_admitted"].items()))
    if m.get("warmup_s"):
        table.add_row("warm-up (not in tokens/s)", f"{m['warmup_s']:.1f} s")
    return table


def _spread(values: Sequence[float] | None, digits: int = 3) -> str:
    """Values per repeat as ``lowest-highest`` (one value: itself), or ``-`` without any."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def _has_cache_time(results: Sequence[dict[str, Any]]) -> bool:
    return any(r["overhead_ratio_model_only"] is not None for r in results)


def _run_label(r: dict[str, Any]) -> str:
    return f"{r['prompt_set']} {r['name']}"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _plain_number(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


# ---------------------------------------------------------------- benchmark: speed
BENCH_COLUMNS = (
    "prompt set",
    "run",
    "tokens/s",
    "vs HF",
    "vs HF mtp",
    "vs plain",
    "vs plain per repeat",
    "auto vs best k",
    "tau",
    "predicted",
    "efficiency",
    "host reads/step",
    "warmup s",
    "per-position acceptance (%)",
    "chosen k",
)


def _chosen_k(chosen: dict[str, int] | None) -> str:
    """``{"2": 30, "0": 4}`` as ``0:4 2:30`` (k: engine steps), or ``-``."""
    if not chosen:
        return "-"
    return " ".join(f"{k}:{n}" for k, n in sorted(chosen.items(), key=lambda kv: int(kv[0])))


def _against_best_k(r: dict[str, Any]) -> str:
    """An auto row against the fastest fixed k, as ``0.89x of k=7 (0.84-0.94)``, or ``-``."""
    ratio = r.get("vs_best_k")
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x of k={r['best_k']} ({_spread(r.get('vs_best_k_per_repeat'), 2)})"


def _bench_cells(r: dict[str, Any]) -> list[str]:
    """One row of the speed table (:data:`BENCH_COLUMNS`); HF rows leave the inkfw columns ``-``."""
    inkfw = r["system"] == "inkfw"
    acceptance = r.get("acceptance_per_position") if inkfw else None
    return [
        r["prompt_set"],
        r["name"],
        f"{r['tokens_per_s']:.1f}",
        _times(r.get("speedup_vs_hf")),
        _times(r.get("speedup_vs_hf_mtp")),
        _times(r.get("speedup_vs_plain")),
        _spread(r.get("speedup_vs_plain_per_repeat"), 2) if r["drafter"] != "none" else "-",
        _against_best_k(r),
        f"{r['mean_acceptance_length']:.2f}" if inkfw else "-",
        _times(r.get("predicted_speedup")),
        _plain_number(r.get("efficiency")),
        f"{r['host_reads_per_step']:.1f}" if inkfw else "-",
        f"{r['warmup_s']:.1f}" if inkfw else "-",
        " ".join(f"{100 * a:.0f}" for a in acceptance) if acceptance else "-",
        _chosen_k(r.get("chosen_k")),
    ]


def _forward_line(report: dict[str, Any]) -> str:
    """The 1-token forward's op count and eager time (``one_token_forward``), or ""."""
    fwd = report.get("one_token_forward") or {}
    parts = [
        f"{mode}: {v['top_level_ops']} top-level aten ops ({v['nested_ops']} in all), {v['wall_ms']:.2f} ms"
        for mode, v in fwd.items()
        if isinstance(v, dict)
    ]
    return f"1-token eager forward at position {fwd['context']}: " + "; ".join(parts) if parts else ""


def _bench_title(report: dict[str, Any]) -> str:
    machine = report["machine"]
    return (
        f"{report['model']['name']}: {report['max_new_tokens']} new tokens per request"
        f"{' (EOS ignored)' if report['ignore_eos'] else ''}, {report['repeats']} repeat(s), "
        f"{machine['threads']} thread(s), {machine['device']}"
        + (f", runs take turns per {report['interleave']}" if report.get("interleave") else "")
    )


def bench_table(report: dict[str, Any]) -> Table:
    """The benchmark's runs (``bench.json``'s ``results``) as a rich table: tokens/s, speed-ups
    over HF ``generate`` / ``generate(use_mtp=True)`` / inkfw plain decoding (and its range
    over repeats), auto's against the fastest fixed k (red below 0.95x, issue 9's target),
    acceptance, predicted speed-up and efficiency, host reads per step, warm-up and the k
    chosen by auto."""
    forward = _forward_line(report)
    table = Table(title=_bench_title(report) + (f"\n{forward}" if forward else ""))
    for col in BENCH_COLUMNS:
        table.add_column(col, justify="left" if col in ("prompt set", "run", "chosen k") else "right")
    for r in report["results"]:
        cells = _bench_cells(r)
        for i, key, bar in ((5, "speedup_vs_plain", 1.0), (7, "vs_best_k", 0.95)):
            ratio = r.get(key)
            if ratio is not None:  # slower than plain decoding, or 5 % below the fastest fixed k: red
                style = "green" if ratio >= bar else "red"
                cells[i] = f"[{style}]{cells[i]}[/{style}]"
        table.add_row(*cells)
    return table


def bench_markdown(report: dict[str, Any]) -> str:
    """``bench.md``: the speed table, the 1-token forward, the engine's step split and overhead
    (:func:`overhead_markdown`), the kernel timings (:func:`kernel_markdown`, when measured) and
    the greedy exactness check."""
    lines = [f"# Benchmark: {_bench_title(report)}", ""]
    forward = _forward_line(report)
    if forward:
        lines += [forward, ""]
    lines += ["| " + " | ".join(BENCH_COLUMNS) + " |", "|" + "---|" * len(BENCH_COLUMNS)]
    lines += ["| " + " | ".join(_bench_cells(r)) + " |" for r in report["results"]]
    inkfw_rows = [r for r in report["results"] if r["system"] == "inkfw"]
    if inkfw_rows:
        lines += ["", "## Engine step and overhead", "", overhead_markdown(inkfw_rows).rstrip("\n")]
    if report.get("kernels"):
        lines += ["", "## Kernels", "", kernel_markdown(report["kernels"]).rstrip("\n")]
    exact = report["exactness"]
    lines += ["", "## Greedy exactness", ""]
    if not exact["checked"]:
        lines.append(f"Not checked: {exact['reason']}.")
    elif exact["ok"]:
        lines.append(f"{exact['runs_compared']} runs emitted their group's reference tokens exactly.")
    else:
        lines += [f"- {m['line']}" for m in exact["mismatches"]]
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def bench_plot(report: dict[str, Any], path: str | Path) -> bool:
    """Tokens/s against k (plain decoding at k = 0, ``auto`` last), one line per mode, drafter
    and batch size, with a bar from the slowest to the fastest repeat (``repeat_tokens_per_s``)
    at each point; HF's baselines dashed; one panel per prompt set. False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    rows = report["results"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    ks = sorted({r["num_tokens"] for r in rows if r["system"] == "inkfw" and isinstance(r["num_tokens"], int)})
    autos = any(r["num_tokens"] == "auto" for r in rows)
    xs = {k: i for i, k in enumerate(ks)} | ({"auto": len(ks)} if autos else {})
    fig, axes = plt.subplots(1, len(sets), figsize=(6.5 * len(sets), 4.5), squeeze=False)
    for ax, name in zip(axes[0], sets):
        mine = [r for r in rows if r["prompt_set"] == name]
        lines: dict[tuple[str, str, int], dict[Any, float]] = {}
        spreads: dict[tuple[str, str, int], dict[Any, list[float]]] = {}  # tokens/s per repeat
        for r in mine:
            if r["system"] != "inkfw":
                continue
            drafters = [d for d in dict.fromkeys(x["drafter"] for x in mine if x["system"] == "inkfw") if d != "none"]
            for drafter in drafters if r["drafter"] == "none" else [r["drafter"]]:  # plain starts every line
                key = (r["mode"], drafter, r["batch_size"])
                lines.setdefault(key, {})[r["num_tokens"]] = r["tokens_per_s"]
                spreads.setdefault(key, {})[r["num_tokens"]] = r.get("repeat_tokens_per_s") or []
        for (mode, drafter, batch), points in lines.items():
            order = sorted(points, key=lambda k: xs[k])
            (line,) = ax.plot(
                [xs[k] for k in order], [points[k] for k in order], marker="o", label=f"{mode} {drafter} b{batch}"
            )
            bars = [(xs[k], min(v), max(v)) for k, v in spreads[(mode, drafter, batch)].items() if len(v) > 1]
            if bars:
                x, low, high = zip(*bars)
                ax.vlines(x, low, high, color=line.get_color(), alpha=0.5, linewidth=3)
        for r, color in zip([r for r in mine if r["system"] == "hf"], ("black", "gray")):
            ax.axhline(r["tokens_per_s"], color=color, linestyle="--", linewidth=1, label=r["name"])
        ax.set_xticks(list(xs.values()), ["plain" if k == 0 else str(k) for k in xs])
        ax.set_xlabel("k (draft tokens per step)")
        ax.set_ylabel("tokens/s")
        ax.set_title(
            name
            + (f" (bars: slowest to fastest of {report['repeats']} repeats)" if report.get("repeats", 1) > 1 else "")
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def bench_acceptance_plot(report: dict[str, Any], path: str | Path) -> bool:
    """Per-position acceptance (%) against the draft position, one curve per drafter and k (in
    the first mode at the first batch size: greedy runs accept alike in every mode); one panel
    per prompt set. False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    rows = [r for r in report["results"] if r["system"] == "inkfw" and r["drafter"] != "none"]
    sets = list(dict.fromkeys(r["prompt_set"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(sets), figsize=(6.5 * len(sets), 4.2), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, name in zip(axes[0], sets):
        mine = [r for r in rows if r["prompt_set"] == name]
        if mine:
            mode, batch = mine[0]["mode"], mine[0]["batch_size"]
            mine = [r for r in mine if r["mode"] == mode and r["batch_size"] == batch]
            ax.set_title(f"{name} ({mode}, batch {batch})")
        for i, r in enumerate(mine):
            acc = r["acceptance_per_position"]
            ax.plot(
                range(1, len(acc) + 1),
                [100 * a for a in acc],
                marker="o",
                color=cmap(i / max(1, len(mine))),
                label=f"{r['drafter']} k={r['num_tokens']} (tau {r['mean_acceptance_length']:.2f})",
            )
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted (% of verify steps)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- benchmark: kernels
KERNEL_COLUMNS = ("op", "shape", "batch", "context", "torch ms", "triton ms", "speed-up", "agree", "max |diff|")


def _kernel_title(kernels: dict[str, Any]) -> str:
    return (
        f"kernels: Triton against the torch reference (verify span T={kernels['span']}, block size "
        f"{kernels['block_size']}, median of {kernels['repeats']})"
        + ("; Triton interpreter on the CPU: its times mean nothing" if kernels["interpreter"] else "")
    )


def _kernel_cells(r: dict[str, Any]) -> list[str]:
    return [
        r["op"],
        r["shape"],
        str(r["batch"]),
        "-" if r["context"] is None else str(r["context"]),
        f"{r['torch_ms']:.3f}",
        f"{r['triton_ms']:.3f}",
        _times(r["speedup"]),
        "yes" if r["agree"] else "NO",
        f"{r['max_abs_diff']:.2g}",
    ]


def kernel_table(kernels: dict[str, Any]) -> Table:
    """``bench.json``'s ``kernels`` section (:func:`inkfw.bench.kernels.kernel_report`) as a rich
    table: per op, batch size and context, the median ms of both implementations, the speed-up
    (green when Triton is faster) and whether they agree (``verify_forward``: the greedy argmax)."""
    table = Table(title=_kernel_title(kernels))
    for col in KERNEL_COLUMNS:
        table.add_column(col, justify="left" if col in ("op", "shape", "agree") else "right")
    for r in kernels["rows"]:
        cells = [escape(c) for c in _kernel_cells(r)]  # op names hold brackets: paged_span_attention[global]
        if r["speedup"] is not None:
            style = "green" if r["speedup"] >= 1.0 else "red"
            cells[6] = f"[{style}]{cells[6]}[/{style}]"
        if not r["agree"]:
            cells[7] = f"[red]{cells[7]}[/red]"
        table.add_row(*cells)
    return table


def kernel_markdown(kernels: dict[str, Any]) -> str:
    """The ``kernels`` section as Markdown: its title, then the table of :func:`kernel_table`."""
    lines = [
        _kernel_title(kernels) + ".",
        "",
        "| " + " | ".join(KERNEL_COLUMNS) + " |",
        "|" + "---|" * len(KERNEL_COLUMNS),
    ]
    lines += ["| " + " | ".join(_kernel_cells(r)) + " |" for r in kernels["rows"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- benchmark: engine overhead
def overhead_markdown(results: Sequence[dict[str, Any]]) -> str:
    """The inkfw runs' step split and overhead (:meth:`inkfw.bench.timing.CaseTiming.result`
    rows) as a Markdown table."""
    cache = _has_cache_time(results)
    head = (
        "| prompt set | run | wall s | tokens/s | steps | step ms | decode step ms | prompt steps | forward ms "
        "| **overhead** | per repeat "
        "| non-fwd ms/step | draft other ms | verify other ms | bookkeeping ms | tau | KV MiB |"
        + (" cache ms in fwd | model-only overhead |" if cache else "")
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        n = max(1, r["num_steps"])
        lines.append(
            f"| {r['prompt_set']} | {r['name']} | {r['wall_s']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['num_steps']} | {r['step_ms']:.1f} | {r['decode_step_ms']:.1f} | "
            f"{_prompt_steps(r)} | {1e3 * r['forward_s'] / n:.1f} | "
            f"**{r['overhead_ratio']:.3f}** | {_spread(r['overhead_ratio_per_repeat'])} | "
            f"{r['non_forward_ms_per_step']:.2f} | {1e3 * r['draft_non_forward_s'] / n:.2f} | "
            f"{1e3 * r['verify_non_forward_s'] / n:.2f} | {1e3 * r['bookkeeping_s'] / n:.2f} | "
            f"{r['mean_acceptance_length']:.2f} | {r['kv_bytes'] / 2**20:.1f} |"
            + (f" {1e3 * r['cache_in_forward_s'] / n:.2f} | {r['overhead_ratio_model_only']:.3f} |" if cache else "")
        )
    return "\n".join(lines) + "\n"


def _prompt_steps(r: dict[str, Any]) -> str:
    """A result row's steps with prompt chunks: ``count x mean ms``."""
    n = r["prompt_steps"]
    return f"{n} x {1e3 * r['prompt_s'] / n:.1f}" if n else "0"


def overhead_table(results: Sequence[dict[str, Any]], profiled: bool = False) -> Table:
    """The inkfw runs' step split and overhead as a rich table (overhead green within the
    target, else red)."""
    table = Table(
        title=f"engine overhead (target <= {OVERHEAD_TARGET})" + ("; cProfile on: times inflated" if profiled else "")
    )
    cache = _has_cache_time(results)
    for col in (
        "run",
        "wall s",
        "tok/s",
        "steps",
        "step ms",
        "decode step ms",
        "prompt steps (ms)",
        "overhead",
        "per repeat",
        "non-fwd ms/step",
        "draft s (fwd)",
        "verify s (fwd)",
        "bookkeep s",
        "tau",
        "KV MiB",
    ):
        table.add_column(col, justify="right" if col != "run" else "left")
    if cache:
        table.add_column("cache ms/step in fwd", justify="right")
        table.add_column("model-only overhead", justify="right")
    for r in results:
        ratio = r["overhead_ratio"]
        style = "green" if ratio <= OVERHEAD_TARGET else "red"
        table.add_row(
            _run_label(r),
            f"{r['wall_s']:.2f}",
            f"{r['tokens_per_s']:.1f}",
            str(r["num_steps"]),
            f"{r['step_ms']:.1f}",
            f"{r['decode_step_ms']:.1f}",
            _prompt_steps(r),
            f"[{style}]{ratio:.3f}[/{style}]",
            _spread(r["overhead_ratio_per_repeat"]),
            f"{r['non_forward_ms_per_step']:.2f}",
            f"{r['draft_s']:.2f} ({r['draft_forward_s']:.2f})",
            f"{r['verify_s']:.2f} ({r['verify_forward_s']:.2f})",
            f"{r['bookkeeping_s']:.3f}",
            f"{r['mean_acceptance_length']:.2f}",
            f"{r['kv_bytes'] / 2**20:.1f}",
            *(
                [
                    f"{1e3 * r['cache_in_forward_s'] / max(1, r['num_steps']):.2f}",
                    f"{r['overhead_ratio_model_only']:.3f}",
                ]
                if cache
                else []
            ),
        )
    return table


def overhead_plot(results: Sequence[dict[str, Any]], path: str | Path) -> bool:
    """Stacked ms/step per inkfw run and the overhead ratio as a PNG; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    names = [_run_label(r).replace(" ", "\n", 1) for r in results]
    parts = [
        ("target forward", "verify_forward_s", "#4c72b0"),
        ("draft forward", "draft_forward_s", "#55a868"),
        ("verify other", "verify_non_forward_s", "#c44e52"),
        ("draft other", "draft_non_forward_s", "#dd8452"),
        ("bookkeeping", "bookkeeping_s", "#8172b3"),
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(11, 0.5 * len(results)), 4.2))
    bottom = [0.0] * len(results)
    for label, key, color in parts:
        vals = [1e3 * r[key] / max(1, r["num_steps"]) for r in results]
        ax1.bar(names, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("ms per engine step")
    ax1.set_title("where a step goes")
    ax1.legend(fontsize=8)
    # overhead share: each non-forward part over the forward time
    bottom = [1.0] * len(results)
    ax2.bar(names, bottom, color="#cccccc", label="forwards (= 1)")
    for label, key, color in parts[2:]:
        vals = [r[key] / r["forward_s"] for r in results]
        ax2.bar(names, vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.axhline(OVERHEAD_TARGET, color="black", linestyle="--", linewidth=1, label=f"target {OVERHEAD_TARGET}")
    ax2.set_ylim(0.9, max(OVERHEAD_TARGET + 0.05, max(bottom) + 0.03))
    ax2.set_ylabel("step time / forward time")
    ax2.set_title("engine overhead")
    ax2.legend(fontsize=8, loc="upper left")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", labelsize=6, rotation=90)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ============================================================================ files
def output_file(value: Any, option: str) -> Path | None:
    """The file path given to ``option`` (None for null or ""), its folder created; checked
    before any work, so a bad path fails at once."""
    if value in (None, ""):
        return None
    path = Path(str(value)).expanduser()
    if path.is_dir():
        raise ConfigError(f"{option}={path} is a directory; give a file path.")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{option}={path}: cannot create its folder ({exc.strerror or exc}).") from exc
    return path


def write_text_atomic(path: str | Path, text: str, option: str | None = None) -> Path:
    """Write ``text`` to ``path`` via a temporary file in the same folder and a rename, so a
    reader never sees a half-written file. An OS error becomes a :class:`ConfigError` naming
    ``option`` (the setting that gave the path) when given."""
    path = Path(path)
    where = f"{option}={path}" if option else str(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot write ({exc.strerror or exc}).") from exc
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ConfigError(f"{where}: cannot write ({exc.strerror or exc}).") from exc
        raise
    return path


def write_json_atomic(path: str | Path, data: Any, option: str | None = "output.json") -> Path:
    """Write ``data`` as indented JSON to ``path`` atomically (see :func:`write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(data, indent=2) + "\n", option)
