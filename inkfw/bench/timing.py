"""Timing of benchmark runs: what the engine's hooks report, summed per configuration.

Everything here watches the engine from outside, through its documented hooks, and never
changes what it computes (docs/design.md §6 defines the timings):

* :class:`PhaseForwardTimer` (an :class:`~inkfw.speculative.observers.EngineObserver`) sums
  the model-forward seconds of each phase: ``target`` (prefill chunks and verify steps) and
  ``draft`` (MTP depths);
* :class:`ProfilerPause` (an observer too) pauses a cProfile profiler inside every forward, so
  the profile holds only the engine's own work;
* :class:`CacheTimer` is :attr:`~inkfw.cache.paged.PagedKVManager.cache_timer`'s hook: the
  seconds of the paged cache's reads and writes inside forwards;
* :class:`CaseTiming` adds up the measured runs of one configuration and gives its result row;
* :func:`predicted_speedup`: the speed-up a run's acceptance and step cost promise over plain
  decoding, to set against the measured one.
"""

from __future__ import annotations

import contextlib
import cProfile
import dataclasses
import io
import pstats
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inkfw.cache.paged import PagedKVManager
from inkfw.errors import ConfigError
from inkfw.speculative.engine import StepTimes
from inkfw.speculative.metrics import SpecMetrics
from inkfw.speculative.observers import EngineObserver, Phase


class PhaseForwardTimer(EngineObserver):
    """Seconds inside model forwards per phase since the last :meth:`reset`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"target": 0.0, "draft": 0.0}

    def on_forward_end(self, phase: Phase, seconds: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds

    def reset(self) -> None:
        self.seconds = {"target": 0.0, "draft": 0.0}


class ProfilerPause(EngineObserver):
    """Pauses ``profiler`` while a model forward runs (only while :attr:`active`), so the
    profile holds the engine's non-forward work: the overhead, nothing else."""

    def __init__(self, profiler: cProfile.Profile) -> None:
        self.profiler = profiler
        self.active = False  # True while the profiler runs (measured runs only)

    def on_forward_start(self, phase: Phase) -> None:
        if self.active:
            self.profiler.disable()

    def on_forward_end(self, phase: Phase, seconds: float) -> None:
        if self.active:
            self.profiler.enable()

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """Profile the block's engine work (forwards excluded)."""
        self.active = True
        self.profiler.enable()
        try:
            yield
        finally:
            self.profiler.disable()
            self.active = False


class CacheTimer:
    """Seconds of the paged cache's reads and writes inside forwards (``update_kv``,
    ``conv_window``), through the KV manager's ``cache_timer`` hook."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, seconds: float) -> None:
        self.seconds += seconds

    @contextlib.contextmanager
    def attached(self, kv: Any) -> Iterator[CacheTimer]:
        """Time ``kv``'s cache work during the block (``kv`` must be a paged KV manager)."""
        if not isinstance(kv, PagedKVManager):
            raise ConfigError(f"cache_time=true times the paged KV cache, but kv builds {type(kv).__name__}.")
        kv.cache_timer = self
        try:
            yield self
        finally:
            kv.cache_timer = None


def add_step_times(a: StepTimes, b: StepTimes) -> StepTimes:
    return StepTimes(**{f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(StepTimes)})


@dataclass
class CaseTiming:
    """One configuration's measured runs, summed over the repeats."""

    drafter: str
    batch_size: int
    num_draft_tokens: int
    wall_s: float = 0.0
    tokens: int = 0
    times: StepTimes = field(default_factory=StepTimes)
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    draft_forward_s: float = 0.0
    target_forward_s: float = 0.0
    overhead_ratios: list[float] = field(default_factory=list)  # one per measured decode (repeat, or slice)
    cache_s: float | None = None  # cache work inside forwards (cache_time=true)
    host_reads: int = 0  # device->host reads during the measured runs (inkfw.profiling.count_host_reads)

    def add_run(
        self,
        wall_s: float,
        tokens: int,
        times: StepTimes,
        metrics: SpecMetrics,
        forwards: PhaseForwardTimer,
        cache_s: float | None = None,
        host_reads: int = 0,
    ) -> float:
        """Add one measured run; returns its overhead ratio (step time / forward time)."""
        self.wall_s += wall_s
        self.host_reads += host_reads
        self.tokens += tokens
        self.times = add_step_times(self.times, times)
        self.metrics.merge(metrics)
        self.draft_forward_s += forwards.seconds.get("draft", 0.0)
        self.target_forward_s += forwards.seconds.get("target", 0.0)
        if cache_s is not None:
            self.cache_s = (self.cache_s or 0.0) + cache_s
        ratio = times.total_s / times.forward_s if times.forward_s else float("nan")
        self.overhead_ratios.append(ratio)
        return ratio

    def result(self, kv_bytes: int) -> dict[str, Any]:
        """The configuration's row of ``bench.json`` (``kv_bytes``: its KV pool's size)."""
        t, m = self.times, self.metrics
        draft_fwd, target_fwd = self.draft_forward_s, self.target_forward_s
        return {
            "drafter": self.drafter,
            "batch_size": self.batch_size,
            "num_draft_tokens": self.num_draft_tokens,
            "wall_s": self.wall_s,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.wall_s if self.wall_s else 0.0,
            "num_steps": t.num_steps,
            "step_s": t.total_s,
            "forward_s": t.forward_s,
            "overhead_ratio": t.total_s / t.forward_s if t.forward_s else float("nan"),
            "overhead_ratio_per_repeat": list(self.overhead_ratios),
            "step_ms": 1e3 * t.total_s / max(1, t.num_steps),
            "decode_steps": t.decode_steps,  # steps without prompt chunks: verify + drafting round
            "decode_step_ms": 1e3 * t.decode_s / max(1, t.decode_steps),
            "prompt_steps": t.prompt_steps,  # steps with prompt chunks (prefill and the drafter's pass)
            "prompt_s": t.prompt_s,
            "non_forward_ms_per_step": 1e3 * (t.total_s - t.forward_s) / max(1, t.num_steps),
            "draft_s": t.draft_s,
            "verify_s": t.verify_s,
            "bookkeeping_s": t.bookkeeping_s,
            "draft_forward_s": draft_fwd,
            "verify_forward_s": target_fwd,  # target forwards: verify steps and prefill chunks
            "draft_non_forward_s": t.draft_s - draft_fwd,
            "verify_non_forward_s": t.verify_s - target_fwd,
            "cache_in_forward_s": self.cache_s,
            "overhead_ratio_model_only": (
                t.total_s / (t.forward_s - self.cache_s)
                if self.cache_s is not None and t.forward_s > self.cache_s
                else None
            ),
            "mean_acceptance_length": m.mean_acceptance_length,
            "acceptance_per_position": m.per_position_acceptance,
            "conditional_acceptance": m.conditional_acceptance,
            "draft_acceptance_rate": m.draft_acceptance_rate,
            "host_reads": self.host_reads,
            "host_reads_per_step": self.host_reads / t.num_steps if t.num_steps else 0.0,
            "kv_bytes": kv_bytes,
        }


def step_cost_s(row: dict[str, Any]) -> float | None:
    """Seconds of the draft and verify phases per engine step of a result row (prefill chunks
    included, bookkeeping not); None without steps."""
    steps = row["num_steps"]
    return (row["draft_s"] + row["verify_s"]) / steps if steps else None


def predicted_speedup(row: dict[str, Any], plain_row: dict[str, Any]) -> float | None:
    """The speed-up over plain decoding that ``row``'s acceptance and step cost promise:
    ``tau * c_plain / c_run``, where ``tau`` is the run's mean acceptance length (tokens per
    request per engine step; plain decoding: 1) and ``c`` the draft + verify seconds per engine
    step (:func:`step_cost_s`) of this run and of ``plain_row``, plain decoding in the same mode
    at the same batch size. Measured speed-up / predicted (the *efficiency*) falls below 1 by
    what the model leaves out: bookkeeping and scheduling outside the two phases, and steps at
    the end of a run with fewer requests in flight. None when either row has no steps."""
    cost, plain_cost = step_cost_s(row), step_cost_s(plain_row)
    if not cost or not plain_cost:
        return None
    return row["mean_acceptance_length"] * plain_cost / cost


def profile_text(prof: cProfile.Profile, result: dict[str, Any], limit: int) -> str:
    """The profile of the engine's non-forward work (the profiler is paused inside forwards).

    Shares of the step time are estimated by scaling each function's profiled time to the
    measured non-forward time; cProfile slows Python more than tensor ops, so read them as a
    ranking, not to the percent. Cumulative times of functions that run a forward (step,
    propose, verify) stop at their first forward and are not meaningful.
    """
    stats = pstats.Stats(prof)
    rows = [(key, val) for key, val in stats.stats.items() if "_lsprof.Profiler" not in key[2]]  # type: ignore[attr-defined]
    profiled = sum(val[2] for _, val in rows) or 1.0
    non_fwd = result["step_s"] - result["forward_s"]
    scale = non_fwd / profiled / result["step_s"] * 100.0  # profiled seconds -> % of step time
    root = Path(__file__).resolve().parent.parent.parent

    def where(key: tuple[str, int, str]) -> str:
        file, line, fn = key
        if file == "~":
            return fn
        try:
            file = str(Path(file).resolve().relative_to(root))
        except ValueError:
            file = "/".join(Path(file).parts[-3:])
        return f"{fn}  {file}:{line}"

    out = io.StringIO()
    out.write(
        f"{result['name']} on {result['prompt_set']} (profiler on): step {result['step_s']:.3f}s, forwards "
        f"{result['forward_s']:.3f}s, overhead {result['overhead_ratio']:.3f}, non-forward {non_fwd:.3f}s; "
        f"profiled non-forward time {profiled:.3f}s\n\n"
    )
    for title, col in (("own time", 2), ("cumulative time", 3)):
        out.write(f"Top functions by {title}, outside model forwards (est. % of step time):\n")
        out.write(f"  {'% step':>7} {'own s':>8} {'cum s':>8} {'calls':>7}  function\n")
        # a function that ran a forward has it in its cumulative time: leave those out
        listed = [kv for kv in rows if col == 2 or kv[1][3] <= profiled]
        for key, (_, nc, tt, ct, _) in sorted(listed, key=lambda kv: kv[1][col], reverse=True)[:limit]:
            out.write(f"  {(tt if col == 2 else ct) * scale:6.2f}% {tt:8.4f} {ct:8.4f} {nc:7d}  {where(key)}\n")
        out.write("\n")
    return out.getvalue()
