"""Engine benchmark behind ``scripts/bench.py``: overhead, speed and cache memory.

For every batch size and drafter it builds one engine, warms it up on other prompts, then
decodes ``max_new_tokens`` greedy tokens for ``batch_size`` random prompts, ``repeats`` times.
The configurations run round-robin (repeat 1 of every configuration, then repeat 2, ...),
so a noisy machine slows them alike and their ratios stay comparable.

Per configuration it reports, summed over the repeats:

* wall time of ``Engine.generate`` and tokens/s (generated tokens / wall);
* step time (``StepTimes.total_s``) and forward time (``StepTimes.forward_s``: time inside the
  model forwards the engine ran: target prefill/verify, MTP depths, logits);
* **overhead** = step time / forward time (the engine's own Python and tensor bookkeeping);
* the step split draft / verify / bookkeeping, each also without its forwards;
* mean acceptance length tau, and the KV pool's bytes (``kv.nbytes``).

Forward time includes the paged cache's reads and writes that the layers do inside a forward
(``PagedLayerCache.update_kv`` / ``conv_window``). ``cache_time=true`` times those apart
(``cache_in_forward_s``) and reports ``overhead_ratio_model_only`` = step time / (forward time
minus that), a stricter view of the engine's cost.

Measuring only: nothing here changes what the engine computes. Speed and memory are measured
here, never in timed tests.
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import platform
import pstats
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import contextlib
import functools

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from inkfw.cache.paged import PagedKVManager, PagedLayerCache
from inkfw.errors import ConfigError
from inkfw.presets import build_model
from inkfw.speculative.drafters import MtpDrafter, NoDrafter
from inkfw.speculative.engine import Engine, EngineConfig, StepTimes
from inkfw.speculative.metrics import SpecMetrics
from inkfw.speculative.sampling import SamplingParams
from inkfw.speculative.verifier import TargetVerifier

DRAFTERS = ("none", "mtp")
OVERHEAD_TARGET = 1.15


class PhaseClock:
    """Forwards one component's model calls to the engine's clock and keeps its own share."""

    def __init__(self, clock):
        self.clock = clock
        self.seconds = 0.0

    def __call__(self, fn, *args):
        before = self.clock.seconds
        out = self.clock(fn, *args)
        self.seconds += self.clock.seconds - before
        return out


class UnprofiledForwards:
    """Engine clock that pauses a cProfile profiler while a model forward runs, so the
    profile holds only the engine's own work: the overhead, nothing else."""

    def __init__(self, clock, profiler: cProfile.Profile):
        self.clock, self.profiler = clock, profiler
        self.active = False  # True while the profiler runs (measured runs only)

    @property
    def seconds(self) -> float:
        return self.clock.seconds

    def __call__(self, fn, *args):
        if not self.active:
            return self.clock(fn, *args)
        self.profiler.disable()
        try:
            return self.clock(fn, *args)
        finally:
            self.profiler.enable()


class CacheTimer:
    """Times the paged cache's work inside model forwards (``PagedLayerCache`` methods)."""

    METHODS = ("update_kv", "conv_window")

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def active(self):
        originals = {name: getattr(PagedLayerCache, name) for name in self.METHODS}

        def timed(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                t = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t
            return wrapper

        try:
            for name, fn in originals.items():
                setattr(PagedLayerCache, name, timed(fn))
            yield self
        finally:
            for name, fn in originals.items():
                setattr(PagedLayerCache, name, fn)


@dataclass
class Case:
    """One configuration: an engine and what its measured runs added up to."""

    drafter: str
    batch_size: int
    engine: Engine
    draft_clock: PhaseClock | None
    verify_clock: PhaseClock
    wall_s: float = 0.0
    tokens: int = 0
    times: StepTimes | None = None
    metrics: SpecMetrics | None = None
    draft_fwd_s: float = 0.0
    verify_fwd_s: float = 0.0
    ratios: list[float] | None = None
    cache_s: float | None = None  # cache work inside forwards (cache_time=true)
    profiler: cProfile.Profile | None = None

    @property
    def name(self) -> str:
        return f"{self.drafter}/b{self.batch_size}"


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive_ints(values: Any, what: str) -> list[int]:
    out = list(values) if isinstance(values, (list, tuple)) or OmegaConf.is_list(values) else [values]
    if not out or not all(_is_count(v) for v in out):
        raise ConfigError(f"{what} must be a list of integers >= 1, got {values!r}.")
    return out


def _positive_int(value: Any, what: str) -> int:
    if not _is_count(value):
        raise ConfigError(f"{what} must be an integer >= 1, got {value!r}.")
    return value


def _build_case(cfg: Any, model, drafter: str, batch_size: int, max_model_len: int) -> Case:
    if drafter == "mtp":
        dr = MtpDrafter(model, num_tokens=cfg.mtp.num_tokens, num_depths=model.num_mtp_depths)
    else:
        dr = NoDrafter()
    kv = PagedKVManager(model, num_draft_depths=dr.num_depths, lookahead=dr.lookahead,
                        block_size=int(cfg.block_size), max_model_len=max_model_len,
                        max_num_seqs=batch_size)
    engine = Engine(model, dr, TargetVerifier(), kv,
                    config=EngineConfig(max_num_seqs=batch_size, max_model_len=max_model_len,
                                        max_num_batched_tokens=int(cfg.max_num_batched_tokens)))
    if bool(cfg.ignore_eos):  # random weights: never stop early, every run decodes the same count
        engine.eos_ids = set()
    profiler = None
    if bool(cfg.profile):
        profiler = cProfile.Profile()
        engine.clock = UnprofiledForwards(engine.clock, profiler)
    verify_clock = PhaseClock(engine.clock)
    engine.verifier.clock = verify_clock
    draft_clock = None
    if hasattr(dr, "clock"):
        draft_clock = PhaseClock(engine.clock)
        dr.clock = draft_clock
    return Case(drafter, batch_size, engine, draft_clock, verify_clock, ratios=[], profiler=profiler)


def _prompts(gen: torch.Generator, batch: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def _generate(case: Case, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    eng = case.engine
    reqs = [eng.add_request(p, SamplingParams(), max_new_tokens=max_new_tokens) for p in prompts]
    t0 = time.perf_counter()
    eng.generate(reqs)
    wall = time.perf_counter() - t0
    bad = [r for r in reqs if r.finish_reason == "error"]
    if bad:
        raise ConfigError(f"{case.name}: request failed: {bad[0].error}")
    return wall, [r.output_token_ids for r in reqs]


def _reset(case: Case) -> None:
    case.engine.times = StepTimes()
    case.engine.metrics = SpecMetrics()
    case.verify_clock.seconds = 0.0
    if case.draft_clock is not None:
        case.draft_clock.seconds = 0.0


def _add_times(total: StepTimes | None, t: StepTimes) -> StepTimes:
    if total is None:
        return StepTimes(t.draft_s, t.verify_s, t.bookkeeping_s, t.forward_s, t.num_steps)
    return StepTimes(total.draft_s + t.draft_s, total.verify_s + t.verify_s, total.bookkeeping_s + t.bookkeeping_s,
                     total.forward_s + t.forward_s, total.num_steps + t.num_steps)


def _result(case: Case) -> dict[str, Any]:
    t, m = case.times, case.metrics
    draft_fwd, verify_fwd = case.draft_fwd_s, case.verify_fwd_s
    prefill_fwd = t.forward_s - draft_fwd - verify_fwd  # engine._prefill calls the clock directly
    return {
        "drafter": case.drafter,
        "batch_size": case.batch_size,
        "num_draft_tokens": case.engine.drafter.num_tokens,
        "wall_s": case.wall_s,
        "tokens": case.tokens,
        "tokens_per_s": case.tokens / case.wall_s if case.wall_s else 0.0,
        "num_steps": t.num_steps,
        "step_s": t.total_s,
        "forward_s": t.forward_s,
        "overhead_ratio": t.total_s / t.forward_s if t.forward_s else float("nan"),
        "overhead_ratio_per_repeat": case.ratios,
        "step_ms": 1e3 * t.total_s / max(1, t.num_steps),
        "non_forward_ms_per_step": 1e3 * (t.total_s - t.forward_s) / max(1, t.num_steps),
        "draft_s": t.draft_s,
        "verify_s": t.verify_s,
        "bookkeeping_s": t.bookkeeping_s,
        "draft_forward_s": draft_fwd,
        "verify_forward_s": verify_fwd + prefill_fwd,  # target forwards: verify steps and prefill chunks
        "draft_non_forward_s": t.draft_s - draft_fwd,
        "verify_non_forward_s": t.verify_s - verify_fwd - prefill_fwd,
        "cache_in_forward_s": case.cache_s,
        "overhead_ratio_model_only": (t.total_s / (t.forward_s - case.cache_s)
                                      if case.cache_s is not None and t.forward_s > case.cache_s else None),
        "mean_acceptance_length": m.mean_acceptance_length,
        "draft_acceptance_rate": m.draft_acceptance_rate,
        "kv_bytes": case.engine.kv.nbytes,
    }


def _profile_text(prof: cProfile.Profile, result: dict[str, Any], limit: int) -> str:
    """The profile of the engine's non-forward work (the profiler is paused inside forwards).

    Shares of the step time are estimated by scaling each function's profiled time to the
    measured non-forward time; cProfile slows Python more than tensor ops, so read them as a
    ranking, not to the percent. Cumulative times of functions that run a forward (step,
    propose, verify) stop at their first forward and are not meaningful.
    """
    stats = pstats.Stats(prof)
    rows = [(key, val) for key, val in stats.stats.items() if "_lsprof.Profiler" not in key[2]]
    profiled = sum(val[2] for _, val in rows) or 1.0
    non_fwd = result["step_s"] - result["forward_s"]
    scale = non_fwd / profiled / result["step_s"] * 100.0  # profiled seconds -> % of step time

    def where(key: tuple[str, int, str]) -> str:
        file, line, fn = key
        if file == "~":
            return fn
        root = Path(__file__).resolve().parent.parent
        try:
            file = str(Path(file).resolve().relative_to(root))
        except ValueError:
            file = "/".join(Path(file).parts[-3:])
        return f"{fn}  {file}:{line}"

    out = io.StringIO()
    out.write(f"{result['drafter']} b={result['batch_size']} (profiler on): step {result['step_s']:.3f}s, forwards "
              f"{result['forward_s']:.3f}s, overhead {result['overhead_ratio']:.3f}, non-forward {non_fwd:.3f}s; "
              f"profiled non-forward time {profiled:.3f}s\n\n")
    for title, col in (("own time", 2), ("cumulative time", 3)):
        out.write(f"Top functions by {title}, outside model forwards (est. % of step time):\n")
        out.write(f"  {'% step':>7} {'own s':>8} {'cum s':>8} {'calls':>7}  function\n")
        # a function that ran a forward has it in its cumulative time: leave those out
        listed = [kv for kv in rows if col == 2 or kv[1][3] <= profiled]
        for key, (cc, nc, tt, ct, _) in sorted(listed, key=lambda kv: kv[1][col], reverse=True)[:limit]:
            out.write(f"  {(tt if col == 2 else ct) * scale:6.2f}% {tt:8.4f} {ct:8.4f} {nc:7d}  {where(key)}\n")
        out.write("\n")
    return out.getvalue()


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def _markdown(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (for benchmarks/README.md)."""
    cache = any(r["overhead_ratio_model_only"] is not None for r in results)
    head = ("| drafter | batch | wall s | tokens/s | steps | step ms | forward ms | **overhead** | per repeat "
            "| non-fwd ms/step | draft other ms | verify other ms | bookkeeping ms | tau | KV MiB |"
            + (" cache ms in fwd | model-only overhead |" if cache else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        n = max(1, r["num_steps"])
        lines.append(
            f"| {r['drafter']} (k={r['num_draft_tokens']}) | {r['batch_size']} | {r['wall_s']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['num_steps']} | {r['step_ms']:.1f} | {1e3 * r['forward_s'] / n:.1f} | "
            f"**{r['overhead_ratio']:.3f}** | {_spread(r['overhead_ratio_per_repeat'])} | "
            f"{r['non_forward_ms_per_step']:.2f} | {1e3 * r['draft_non_forward_s'] / n:.2f} | "
            f"{1e3 * r['verify_non_forward_s'] / n:.2f} | {1e3 * r['bookkeeping_s'] / n:.2f} | "
            f"{r['mean_acceptance_length']:.2f} | {r['kv_bytes'] / 2**20:.1f} |"
            + (f" {1e3 * r['cache_in_forward_s'] / n:.2f} | {r['overhead_ratio_model_only']:.3f} |" if cache else ""))
    return "\n".join(lines) + "\n"


def _table(results: list[dict[str, Any]], profiled: bool = False) -> Table:
    table = Table(title=f"engine overhead (target <= {OVERHEAD_TARGET})" + (
        "; cProfile on: times inflated" if profiled else ""))
    cache = any(r["overhead_ratio_model_only"] is not None for r in results)
    for col in ("config", "wall s", "tok/s", "steps", "step ms", "overhead", "per repeat", "non-fwd ms/step",
                "draft s (fwd)", "verify s (fwd)", "bookkeep s", "tau", "KV MiB"):
        table.add_column(col, justify="right" if col != "config" else "left")
    if cache:
        table.add_column("cache ms/step in fwd", justify="right")
        table.add_column("model-only overhead", justify="right")
    for r in results:
        ratio = r["overhead_ratio"]
        style = "green" if ratio <= OVERHEAD_TARGET else "red"
        table.add_row(
            f"{r['drafter']} k={r['num_draft_tokens']} b={r['batch_size']}", f"{r['wall_s']:.2f}",
            f"{r['tokens_per_s']:.1f}", str(r["num_steps"]), f"{r['step_ms']:.1f}",
            f"[{style}]{ratio:.3f}[/{style}]", _spread(r["overhead_ratio_per_repeat"]),
            f"{r['non_forward_ms_per_step']:.2f}",
            f"{r['draft_s']:.2f} ({r['draft_forward_s']:.2f})", f"{r['verify_s']:.2f} ({r['verify_forward_s']:.2f})",
            f"{r['bookkeeping_s']:.3f}", f"{r['mean_acceptance_length']:.2f}", f"{r['kv_bytes'] / 2**20:.1f}",
            *([f"{1e3 * r['cache_in_forward_s'] / max(1, r['num_steps']):.2f}",
               f"{r['overhead_ratio_model_only']:.3f}"] if cache else []))
    return table


def _plot(results: list[dict[str, Any]], path: Path) -> bool:
    """Stacked ms/step per configuration and the overhead ratio; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [f"{r['drafter']}\nb={r['batch_size']}" for r in results]
    parts = [("target forward", "verify_forward_s", "#4c72b0"), ("draft forward", "draft_forward_s", "#55a868"),
             ("verify other", "verify_non_forward_s", "#c44e52"), ("draft other", "draft_non_forward_s", "#dd8452"),
             ("bookkeeping", "bookkeeping_s", "#8172b3")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_bench(cfg: Any) -> dict[str, Any]:
    console = Console()
    if not console.is_terminal:  # piped or logged: keep the table on one line per row
        console = Console(width=200)
    batch_sizes = _positive_ints(cfg.batch_sizes, "batch_sizes")
    drafters = list(cfg.drafters) if OmegaConf.is_list(cfg.drafters) or isinstance(cfg.drafters, list) \
        else [cfg.drafters]
    if not drafters or any(d not in DRAFTERS for d in drafters):
        raise ConfigError(f"drafters must be a list drawn from {', '.join(DRAFTERS)}, got {list(drafters)!r}.")
    for name in ("prompt_len", "max_new_tokens", "repeats", "block_size", "max_num_batched_tokens"):
        _positive_int(cfg[name], name)
    if not isinstance(cfg.warmup_tokens, int) or cfg.warmup_tokens < 0:
        raise ConfigError(f"warmup_tokens must be an integer >= 0, got {cfg.warmup_tokens!r}.")
    if cfg.mtp.num_tokens is not None:
        _positive_int(cfg.mtp.num_tokens, "mtp.num_tokens")
    if cfg.threads is not None:
        torch.set_num_threads(_positive_int(cfg.threads, "threads"))

    model = build_model(cfg.model, mtp_depths=cfg.mtp.depths, dtype=cfg.dtype, device=cfg.device)
    mcfg = model.cfg
    if "mtp" in drafters and model.num_mtp_depths == 0:
        raise ConfigError(f"drafter mtp needs MTP depths; model preset {cfg.model.get('name')!r} built none.")
    prompt_len, new = int(cfg.prompt_len), int(cfg.max_new_tokens)
    k = model.num_mtp_depths if cfg.mtp.num_tokens is None else int(cfg.mtp.num_tokens)
    max_model_len = prompt_len + max(new, int(cfg.warmup_tokens)) + k + int(cfg.block_size)
    if max_model_len > mcfg.max_position_embeddings:
        raise ConfigError(f"prompt_len + max_new_tokens ({prompt_len + new}) leaves no room below the model limit "
                          f"{mcfg.max_position_embeddings}.")
    gen = torch.Generator().manual_seed(int(cfg.seed))
    vocab = mcfg.logits_vocab_size

    cases = [_build_case(cfg, model, d, b, max_model_len) for b in batch_sizes for d in drafters]
    console.print(f"model {cfg.model.get('name')}: {mcfg.num_layers} layers, hidden {mcfg.hidden_size}, "
                  f"vocab {mcfg.vocab_size}, {model.num_mtp_depths} MTP depths; torch {torch.__version__}, "
                  f"{torch.get_num_threads()} thread(s), device {cfg.device}")
    if int(cfg.warmup_tokens) > 0:
        for case in cases:
            _generate(case, _prompts(gen, case.batch_size, prompt_len, vocab), int(cfg.warmup_tokens))
    mismatches: dict[int, int] = {b: 0 for b in batch_sizes}  # greedy: every drafter must emit the same tokens
    for rep in range(int(cfg.repeats)):
        prompts_for = {b: _prompts(gen, b, prompt_len, vocab) for b in batch_sizes}  # same prompts per drafter
        outputs: dict[int, list[list[int]]] = {}
        for case in cases:
            prompts = prompts_for[case.batch_size]
            _reset(case)
            if case.profiler is not None:
                case.engine.clock.active = True
                case.profiler.enable()
            timer = CacheTimer()
            with timer.active() if cfg.cache_time else contextlib.nullcontext():
                wall, outs = _generate(case, prompts, new)
            if cfg.cache_time:
                case.cache_s = (case.cache_s or 0.0) + timer.seconds
            if case.profiler is not None:
                case.profiler.disable()
                case.engine.clock.active = False
            tokens = sum(len(o) for o in outs)
            first = outputs.setdefault(case.batch_size, outs)
            mismatches[case.batch_size] += sum(a != b for a, b in zip(first, outs))
            t = case.engine.times
            case.wall_s += wall
            case.tokens += tokens
            case.times = _add_times(case.times, t)
            case.ratios.append(t.total_s / t.forward_s if t.forward_s else float("nan"))
            if case.metrics is None:
                case.metrics = SpecMetrics()
            case.metrics.merge(case.engine.metrics)
            case.draft_fwd_s += case.draft_clock.seconds if case.draft_clock is not None else 0.0
            case.verify_fwd_s += case.verify_clock.seconds
            console.print(f"  repeat {rep + 1}/{cfg.repeats} {case.name}: {wall:.2f}s, "
                          f"overhead {case.ratios[-1]:.3f}")

    results = [_result(c) for c in cases]
    for r in results:
        r["greedy_output_mismatches"] = mismatches[r["batch_size"]]
    console.print(_table(results, bool(cfg.profile)))
    by = {(r["drafter"], r["batch_size"]): r for r in results}
    for b in batch_sizes:
        if ("none", b) in by and ("mtp", b) in by:
            none, mtp = by[("none", b)], by[("mtp", b)]
            console.print(f"batch {b}: mtp/none tokens/s = {mtp['tokens_per_s'] / none['tokens_per_s']:.3f} "
                          f"(tau {mtp['mean_acceptance_length']:.2f}; random weights accept almost nothing); "
                          f"requests whose greedy output differs between drafters: {mismatches[b]}")

    report = {
        "config": OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "cpu_count": os.cpu_count()},
        "model": {"name": cfg.model.get("name"), "num_layers": mcfg.num_layers, "hidden_size": mcfg.hidden_size,
                  "vocab_size": mcfg.vocab_size, "mtp_depths": model.num_mtp_depths},
        "overhead_target": OVERHEAD_TARGET,
        "results": results,
    }
    if cfg.output_dir:
        out = Path(str(cfg.output_dir))
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "bench.md").write_text(_markdown(results))
        written = [out / "bench.json", out / "bench.md"]
        if cfg.plot and _plot(results, out / "bench.png"):
            written.append(out / "bench.png")
        elif cfg.plot:
            console.print("[yellow]matplotlib is not installed: no plot (pip install matplotlib)[/yellow]")
        for case, result in zip(cases, results):
            if case.profiler is not None:
                path = out / f"profile-{case.name.replace('/', '-')}.txt"
                path.write_text(_profile_text(case.profiler, result, int(cfg.profile_lines)))
                written.append(path)
        console.print("wrote " + ", ".join(str(p) for p in written))
    return report
