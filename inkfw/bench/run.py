"""The benchmark behind ``scripts/bench.py``: inkfw against HF ``generate`` on one checkpoint.

In one process, on one model (the shipped ``checkpoints/inkling-tiny`` by default), round-robin
(:mod:`inkfw.bench.plan`):

* HF transformers ``generate`` and ``generate(use_mtp=True)`` at batch 1
  (:mod:`inkfw.bench.hf_baseline`);
* the inkfw engine, plain (``drafter=none``) and drafting (``drafter=mtp``, k from ``num_tokens``:
  integers and ``auto``), in each mode (``eager``, ``compiled``: ``engine.compile=true``,
  ``graphs``: CUDA graphs) at each batch size,

on each prompt set (:mod:`inkfw.bench.prompt_sets`: held-out stdlib prompts, HumanEval), greedy,
the same ``max_new_tokens`` for all. Every engine is built once through the serving factory
(:func:`~inkfw.speculative.factory.build_engine`, around the one shared model) and warmed up
(:meth:`Engine.warmup` for its batch size, timed as ``warmup_s``, then a short unmeasured
generate of one batch per prompt set); neither counts in tokens/s. A round decodes every prompt set with every run; the
benchmark makes ``repeats`` rounds, every other one in reverse order, and sums them. Within a
round runs take turns per slice of prompts (``interleave=batch``) or per prompt set
(``interleave=set``; :func:`~inkfw.bench.plan.interleaved_batches`).

Reported per run (``bench.json``; rendered by :mod:`inkfw.reporting`):

* tokens/s = generated tokens / wall time of ``Engine.generate`` (HF: of the ``generate``
  calls), and the speed-up over HF ``generate``, HF ``generate(use_mtp=True)`` and inkfw plain
  decoding in the same mode at the same batch size, the last also per repeat, and ``auto``
  against the fastest fixed k (:func:`add_repeat_ratios`);
* mean acceptance length, per-position and conditional acceptance (docs/design.md §6);
* predicted speed-up (:func:`inkfw.bench.timing.predicted_speedup`) and efficiency =
  measured / predicted speed-up over plain decoding;
* host reads per engine step (:func:`inkfw.profiling.count_host_reads` around the measured
  ``generate``, prefill steps included), ``warmup_s``, the k chosen per step with ``auto``;
* the engine's step split and overhead = step time / forward time (:mod:`inkfw.bench.timing`).

Once per model: top-level aten ops and eager wall time of a 1-token forward
(:mod:`inkfw.profiling`, as ``scripts/count_ops.py`` counts them), and with ``kernel_timings``
each Triton kernel against its torch reference and the verify forward with both kernel backends
(:mod:`inkfw.bench.kernels`; ``bench.json``'s ``kernels``).

Greedy outputs are checked token for token (:mod:`inkfw.bench.exactness`); a difference makes
the command exit 1 after its files are written. Measuring only: nothing here changes what the
engine computes.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import platform
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict
from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress

from inkfw.bench.exactness import ExactnessCheck, differing_requests, unchecked_summary
from inkfw.bench.hf_baseline import HfBaseline
from inkfw.bench.kernels import kernel_bench_options, kernel_report
from inkfw.bench.plan import (
    AUTO,
    HF_SYSTEMS,
    INTERLEAVE,
    MODES,
    BenchRun,
    NumTokens,
    choices,
    interleaved_batches,
    num_tokens_list,
    plan_runs,
    positive_ints,
    round_order,
)
from inkfw.bench.prompt_sets import NAMED_SETS, batch_requests, load_prompt_set
from inkfw.bench.timing import (
    CacheTimer,
    CaseTiming,
    PhaseForwardTimer,
    ProfilerPause,
    predicted_speedup,
    profile_text,
)
from inkfw.errors import ConfigError
from inkfw.options import bool_option, int_option
from inkfw.paths import config_dir
from inkfw.presets import build_model, model_config, parse_dtype, plain, resolve_device, resolve_path
from inkfw.profiling import FORWARD_MODES, count_aten_ops, count_host_reads, one_token_forwards, wall_time
from inkfw.reporting import (
    bench_acceptance_plot,
    bench_markdown,
    bench_plot,
    bench_table,
    counts_json,
    kernel_table,
    overhead_plot,
    overhead_table,
    write_json_atomic,
    write_text_atomic,
)
from inkfw.speculative.engine import Engine, StepTimes
from inkfw.speculative.factory import build_engine, drafter_kind, load_tokenizer, serving_config
from inkfw.speculative.metrics import SpecMetrics
from inkfw.speculative.step import power_of_two_bucket


# ------------------------------------------------------------------------ options
@dataclass
class BenchOptions:
    """The benchmark's own options (``inkfw/conf/bench.yaml``), validated."""

    prompt_sets: list[str]
    num_prompts: int | None
    batch_sizes: list[int]
    modes: list[str]
    drafters: list[str]
    num_tokens: list[NumTokens]
    hf: list[str]
    max_new_tokens: int
    prompt_len: int
    warmup_tokens: int
    repeats: int
    ignore_eos: bool
    plot: bool  # the PNGs
    cache_time: bool  # time the paged cache's reads/writes inside forwards
    profile: bool  # cProfile each measured run
    profile_lines: int  # functions per profile listing
    forward_ops: list[str]
    forward_repeats: int
    interleave: str  # INTERLEAVE: runs take turns per prompt set or per batch
    auto_modes: list[str] | None = None  # the modes that run k = auto (None: every mode)

    def runs(self) -> list[BenchRun]:
        return plan_runs(self.drafters, self.num_tokens, self.modes, self.batch_sizes, self.hf, self.auto_modes)


def _one_of(value: Any, what: str, options: tuple[str, ...]) -> str:
    if value not in options:
        raise ConfigError(f"{what} must be one of {', '.join(options)}, got {plain(value)!r}.")
    return value


def drafter_options() -> list[str]:
    """The ``inkfw/conf/drafter`` options a benchmark can compare."""
    return sorted(p.stem for p in (config_dir() / "drafter").glob("*.yaml"))


def bench_options(cfg: Any) -> BenchOptions:
    """Check the benchmark's options; a bad one raises :class:`ConfigError` (one sentence)."""
    sets = plain(cfg.prompt_sets)
    sets = list(sets) if isinstance(sets, (list, tuple)) else [sets]
    if not sets or not all(isinstance(s, str) and s for s in sets):
        raise ConfigError(
            f"prompt_sets must be a non-empty list of prompt set names ({', '.join(NAMED_SETS)}) or .jsonl files, "
            f"got {plain(cfg.prompt_sets)!r}."
        )
    num_prompts = cfg.num_prompts
    if num_prompts is not None:
        int_option(num_prompts, "num_prompts (null: every prompt of a set)")
    if cfg.spec.get("num_tokens") is not None:
        raise ConfigError(
            f"spec.num_tokens is set per run from num_tokens; give num_tokens=[{cfg.spec.num_tokens}] instead."
        )
    return BenchOptions(
        prompt_sets=list(dict.fromkeys(sets)),
        num_prompts=num_prompts,
        batch_sizes=positive_ints(cfg.batch_sizes, "batch_sizes"),
        modes=choices(cfg.modes, "modes", tuple(MODES)),
        drafters=choices(cfg.drafters, "drafters", drafter_options()),
        num_tokens=num_tokens_list(cfg.num_tokens),
        hf=choices(cfg.hf, "hf", tuple(HF_SYSTEMS), allow_empty=True),
        max_new_tokens=int_option(cfg.max_new_tokens, "max_new_tokens"),
        prompt_len=int_option(cfg.prompt_len, "prompt_len"),
        warmup_tokens=int_option(cfg.warmup_tokens, "warmup_tokens", 0),
        repeats=int_option(cfg.repeats, "repeats"),
        ignore_eos=bool_option(cfg.ignore_eos, "ignore_eos"),
        plot=bool_option(cfg.plot, "plot"),
        cache_time=bool_option(cfg.cache_time, "cache_time"),
        profile=bool_option(cfg.profile, "profile"),
        profile_lines=int_option(cfg.profile_lines, "profile_lines"),
        forward_ops=choices(cfg.forward_ops, "forward_ops", FORWARD_MODES, allow_empty=True),
        forward_repeats=int_option(cfg.forward_repeats, "forward_repeats"),
        interleave=_one_of(cfg.interleave, "interleave", INTERLEAVE),
        auto_modes=None
        if cfg.get("auto_modes") is None
        else choices(cfg.auto_modes, "auto_modes (null: every mode)", tuple(MODES), allow_empty=True),
    )


def _greedy(cfg: Any) -> bool:
    temperature = cfg.sampler.get("temperature", 0.0) if cfg.get("sampler") is not None else 0.0
    return not temperature


def _max_draft_tokens(opts: BenchOptions, cfg: Any, depths: int) -> int:
    """The most draft tokens any planned run verifies per step (auto: spec.max_num_tokens, null: D)."""
    if opts.drafters == ["none"]:
        return 0
    auto_max = cfg.spec.get("max_num_tokens")
    return max(int(k) if k != AUTO else int(auto_max if auto_max is not None else depths) for k in opts.num_tokens)


# ------------------------------------------------------------------------ engines
@dataclass
class Case:
    """One inkfw engine (mode, drafter, k, batch size), its observers, and its measured runs per
    prompt set."""

    run: BenchRun
    engine: Engine
    forwards: PhaseForwardTimer
    profile: bool = False  # cProfile the measured runs, one profiler per prompt set
    timings: dict[str, CaseTiming] = field(default_factory=dict)
    profilers: dict[str, ProfilerPause] = field(default_factory=dict)
    chosen_k: dict[str, Counter[int]] = field(default_factory=dict)  # auto: k -> engine steps, per set
    depths_admitted: dict[str, Counter[int]] = field(default_factory=dict)  # auto: depths -> requests, per set

    @property
    def warmup_s(self) -> float:
        """The engine's warm-up: Engine.warmup, and compiles / captures met in the warm batch or
        the measured runs (left out of their wall time)."""
        return self.engine.warmup_s

    def timing(self, prompt_set: str) -> CaseTiming:
        if prompt_set not in self.timings:
            r = self.run
            self.timings[prompt_set] = CaseTiming(r.drafter, r.batch_size, int(self.engine.drafter.num_tokens))
        return self.timings[prompt_set]

    def profiling(self, prompt_set: str) -> contextlib.AbstractContextManager:
        """Profile the block's engine work (forwards excluded) into ``prompt_set``'s profiler."""
        if not self.profile:
            return contextlib.nullcontext()
        if prompt_set not in self.profilers:
            self.profilers[prompt_set] = ProfilerPause(cProfile.Profile())
            self.engine.add_observer(self.profilers[prompt_set])  # pauses it inside forwards
        return self.profilers[prompt_set].profiling()


def _drafter_node(cfg: Any, name: str) -> Any:
    """The ``inkfw/conf/drafter/<name>`` node; the one ``drafter=`` selected keeps its overrides."""
    if drafter_kind(cfg.get("drafter")) == name:
        return cfg.drafter
    return serving_config([f"drafter={name}"]).drafter


def shared_max_model_len(needed: int, limit: int) -> int:
    """The engines' ``max_model_len`` for runs that need ``needed`` positions: the next power of
    two (at least 256, at most the model's ``limit``). It sizes the KV pools, which compiled step
    graphs are specialised on, so inductor's on-disk cache serves a graph only to engines of the
    same length: rounded, benches over other prompt sets or counts reuse the graphs compiled
    before (plain decoding's warm-up: 7 s against 65 s cold on the shipped checkpoint, CPU)."""
    return min(limit, power_of_two_bucket(needed, 256))


def case_config(cfg: Any, run: BenchRun, max_model_len: int) -> Any:
    """The serving config of ``run``'s engine: its drafter, k, mode and batch size."""
    case = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(case):
        case.drafter = _drafter_node(cfg, run.drafter)
        case.spec.num_tokens = None if run.drafter == "none" else run.num_tokens
        case.engine.max_num_seqs = run.batch_size
        case.engine.max_model_len = max_model_len
        for key, value in MODES[run.mode].items():
            case.engine[key] = value
    return case


def _build_case(cfg: Any, opts: BenchOptions, run: BenchRun, model, tokenizer, max_model_len: int) -> Case:
    engine, _ = build_engine(case_config(cfg, run, max_model_len), model=model, tokenizer=tokenizer)
    if opts.ignore_eos:  # every request decodes max_new_tokens (HF: eos_token_id=[])
        engine.eos_ids = set()
    forwards = PhaseForwardTimer()
    engine.add_observer(forwards)
    # compile / capture, step costs for auto, at every bucket the run's batches pass through: as
    # requests finish at different steps a batch of B shrinks through the buckets below B, and a
    # bucket first met while measuring would time its compiles (minutes on a CPU) as decoding
    engine.warmup(range(1, run.batch_size + 1))
    return Case(run, engine, forwards, profile=opts.profile)


def _generate(
    engine: Engine, prompts: list[list[int]], max_new_tokens: int, what: str
) -> tuple[float, list[list[int]]]:
    params = engine.sampler.defaults  # inkfw/conf/sampler: greedy unless told otherwise
    requests = [engine.add_request(p, params, max_new_tokens=max_new_tokens) for p in prompts]
    start = time.perf_counter()
    engine.generate(requests)
    wall = time.perf_counter() - start
    failed = [r for r in requests if r.finish_reason == "error"]
    if failed:
        raise ConfigError(f"{what}: request failed: {failed[0].error}")
    return wall, [r.output_token_ids for r in requests]


def _measure(case: Case, prompt_set: str, prompts: list[list[int]], max_new_tokens: int, cache_time: bool):
    """One measured run of ``case`` on ``prompts`` (statistics from zero, added to its timing of
    ``prompt_set``): (wall seconds, output token ids)."""
    engine = case.engine
    engine.times, engine.metrics = StepTimes(), SpecMetrics()
    case.forwards.reset()
    adaptive = engine.adaptive  # spec.num_tokens=auto
    chosen_before = Counter(adaptive.chosen) if adaptive is not None else Counter()
    depths_before = Counter(engine.depths_admitted)
    timer = CacheTimer()
    with (
        count_host_reads() as reads,
        timer.attached(engine.kv) if cache_time else contextlib.nullcontext(),
        case.profiling(prompt_set),
    ):
        warmup_s = engine.warmup_s
        wall, outs = _generate(engine, prompts, max_new_tokens, f"{prompt_set} {case.run.name}")
    wall -= engine.warmup_s - warmup_s  # compiles / captures of shapes first met in this run
    case.timing(prompt_set).add_run(
        wall,
        sum(len(o) for o in outs),
        engine.times,
        engine.metrics,
        case.forwards,
        timer.seconds if cache_time else None,
        reads.count,
    )
    if adaptive is not None:
        chosen = case.chosen_k.setdefault(prompt_set, Counter())
        chosen.update(Counter(adaptive.chosen) - chosen_before)
        admitted = case.depths_admitted.setdefault(prompt_set, Counter())
        admitted.update(Counter(engine.depths_admitted) - depths_before)
    return wall, outs


# ------------------------------------------------------------------------ rows
@dataclass
class HfTiming:
    """One HF baseline's measured runs on one prompt set, summed."""

    wall_s: float = 0.0
    tokens: int = 0
    num_requests: int = 0


def _hf_row(run: BenchRun, prompt_set: str, timing: HfTiming) -> dict[str, Any]:
    return {
        "system": "hf",
        "name": run.name,
        "prompt_set": prompt_set,
        "mode": run.mode,
        "drafter": run.drafter,
        "num_tokens": 0,
        "batch_size": run.batch_size,
        "wall_s": timing.wall_s,
        "tokens": timing.tokens,
        "num_requests": timing.num_requests,
        "tokens_per_s": timing.tokens / timing.wall_s if timing.wall_s else 0.0,
    }


def _inkfw_row(case: Case, prompt_set: str) -> dict[str, Any]:
    engine = case.engine
    row = case.timing(prompt_set).result(engine.kv.nbytes)
    chosen, admitted = case.chosen_k.get(prompt_set), case.depths_admitted.get(prompt_set)
    row.update(
        {
            "system": "inkfw",
            "name": case.run.name,
            "prompt_set": prompt_set,
            "mode": case.run.mode,
            "num_tokens": case.run.num_tokens,
            "warmup_s": case.warmup_s,
            "chosen_k": counts_json(chosen) if chosen is not None else None,
            "depths_admitted": counts_json(admitted) if admitted is not None else None,
            "adaptive": engine.adaptive.summary() if engine.adaptive is not None else None,
        }
    )
    row["adaptive_predicted_speedup"] = adaptive_predicted_speedup(row["adaptive"], case.run.batch_size)
    return row


def adaptive_predicted_speedup(summary: dict[str, Any] | None, batch_size: int) -> float | None:
    """The speed-up over plain decoding that auto's own model expects at ``batch_size``
    (:meth:`AdaptiveK.summary`, at the end of the benchmark): ``E(k*) * step_s[0] / step_s[k*]``
    (step costs with catch-ups)
    for its best k at the smallest bucket with measured costs that holds the batch. None
    without such costs (or without auto)."""
    if summary is None:
        return None
    buckets = sorted(int(b) for b in summary["costs"] if int(b) >= batch_size)
    if not buckets:
        return None
    costs = summary.get("costs_now", summary["costs"])[str(buckets[0])]
    k = int(summary["best_k"][str(buckets[0])])
    return summary["expected_tokens"][k] * costs[0] / costs[k]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _group(r: dict[str, Any]) -> tuple[str, str, int]:
    """Rows compared with each other: same prompt set, mode and batch size."""
    return (r["prompt_set"], r["mode"], r["batch_size"])


def _plain_rows(rows: list[dict[str, Any]]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """Each :func:`_group`'s inkfw plain-decoding row."""
    return {_group(r): r for r in rows if r["system"] == "inkfw" and r["drafter"] == "none"}


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Per row, in place: tokens/s over HF ``generate`` and ``generate(use_mtp=True)`` of the same
    prompt set (``speedup_vs_hf``, ``speedup_vs_hf_mtp``); for inkfw rows also over plain
    decoding in the same mode and batch size (``speedup_vs_plain``), the speed-up acceptance
    and step cost predict (``predicted_speedup``) and measured / predicted (``efficiency``).
    A ratio without its baseline row is None."""
    hf = {(r["prompt_set"], r["drafter"]): r["tokens_per_s"] for r in rows if r["system"] == "hf"}
    plain_rows = _plain_rows(rows)
    for r in rows:
        r["speedup_vs_hf"] = _ratio(r["tokens_per_s"], hf.get((r["prompt_set"], "none")))
        r["speedup_vs_hf_mtp"] = _ratio(r["tokens_per_s"], hf.get((r["prompt_set"], "mtp")))
        if r["system"] != "inkfw":
            continue
        base = plain_rows.get(_group(r))
        r["speedup_vs_plain"] = _ratio(r["tokens_per_s"], base["tokens_per_s"]) if base else None
        r["predicted_speedup"] = predicted_speedup(r, base) if base else None
        r["efficiency"] = _ratio(r["speedup_vs_plain"], r["predicted_speedup"])


def _per_repeat(a: list[float] | None, b: list[float] | None) -> list[float] | None:
    """Two runs' tokens/s ratio in each repeat (``repeat_tokens_per_s``), or None without both."""
    if a is None or b is None:
        return None
    return [x / y if y else 0.0 for x, y in zip(a, b, strict=True)]


def add_repeat_ratios(rows: list[dict[str, Any]]) -> None:
    """Per inkfw row, in place, from ``repeat_tokens_per_s`` (its tokens/s in each repeat):
    ``speedup_vs_plain_per_repeat``, the ratio over plain decoding (same mode and batch size)
    repeat by repeat, whose spread shows the timing noise of ``speedup_vs_plain``; for ``auto``
    rows ``best_k``, the fixed k (plain decoding as 0) of the same drafter, mode and batch size
    with the most tokens/s, ``vs_best_k`` = auto's tokens/s over that k's, and
    ``vs_best_k_per_repeat``. Per repeat, not per prompt: acceptance varies 3x between prompts,
    so a median of per-prompt ratios would not be a ratio of throughputs."""
    inkfw = [r for r in rows if r["system"] == "inkfw"]
    plain_rows = _plain_rows(rows)
    for r in inkfw:
        plain_row = plain_rows.get(_group(r))
        repeat_tps = r.get("repeat_tokens_per_s")
        r["speedup_vs_plain_per_repeat"] = _per_repeat(
            repeat_tps, plain_row.get("repeat_tokens_per_s") if plain_row is not None else None
        )
        r["best_k"] = r["vs_best_k"] = r["vs_best_k_per_repeat"] = None
        fixed = [
            o
            for o in inkfw
            if _group(o) == _group(r)
            and (o["drafter"] == "none" or (o["drafter"] == r["drafter"] and o["num_tokens"] != AUTO))
        ]
        if r["num_tokens"] != AUTO or not fixed:
            continue
        best = max(fixed, key=lambda o: o["tokens_per_s"])
        r["best_k"] = int(best["num_tokens"])
        r["vs_best_k"] = _ratio(r["tokens_per_s"], best["tokens_per_s"])
        r["vs_best_k_per_repeat"] = _per_repeat(repeat_tps, best.get("repeat_tokens_per_s"))


def one_token_forward_report(model, modes: list[str], repeats: int, context: int = 32) -> dict[str, Any]:
    """Top-level (and all) aten ops and median eager wall time of a 1-token forward of ``model``
    per mode of :func:`inkfw.profiling.one_token_forwards` (what ``scripts/count_ops.py`` prints)."""
    if not modes:
        return {}
    forwards = one_token_forwards(model, context=context)
    out: dict[str, Any] = {"context": context, "threads": torch.get_num_threads()}
    for mode in modes:
        fn = forwards[mode]
        out[mode] = {
            "top_level_ops": count_aten_ops(fn),
            "nested_ops": count_aten_ops(fn, nested=True),
            "wall_ms": 1e3 * wall_time(fn, repeats=repeats),
        }
    return out


@dataclass
class Rounds:
    """The measured runs, round by round: HF timings summed per (prompt set, run), inkfw timings
    in each :class:`Case`, greedy outputs compared as they come."""

    console: Console
    cases: dict[tuple, Case]
    hf: HfBaseline | None
    check: ExactnessCheck | None  # None: sampling, outputs not compared
    on_decode: Callable[[], None] = lambda: None  # after each measured decode (the progress bar)
    started: float = field(default_factory=time.perf_counter)  # the bench's start (progress lines' "at")
    hf_timings: dict[tuple[str, str], HfTiming] = field(default_factory=dict)
    hf_vs_inkfw: dict[str, dict[str, int]] = field(default_factory=dict)  # info: HF vs inkfw at batch 1
    # per (prompt set, run name): (repeat, tokens, wall seconds) of each measured decode, in order
    decodes: dict[tuple[str, str], list[tuple[int, int, float]]] = field(default_factory=dict)

    def repeat_totals(self, set_name: str, run_name: str) -> dict[int, tuple[int, float]]:
        """The run's (tokens, wall seconds) on ``set_name`` per repeat: its decodes of that repeat."""
        totals: dict[int, tuple[int, float]] = {}
        for rep, tokens, wall in self.decodes[(set_name, run_name)]:
            done, seconds = totals.get(rep, (0, 0.0))
            totals[rep] = (done + tokens, seconds + wall)
        return totals

    def repeat_tokens_per_s(self, set_name: str, run_name: str) -> list[float]:
        """The run's tokens/s on ``set_name`` in each repeat."""
        return [tokens / wall if wall else 0.0 for tokens, wall in self.repeat_totals(set_name, run_name).values()]

    def measure(
        self,
        rep: int,
        repeats: int,
        set_name: str,
        batches: list[list[list[int]]],
        runs: list[BenchRun],
        max_new_tokens: int,
        cache_time: bool,
    ) -> None:
        """Repeat ``rep`` of every run on prompt set ``set_name``, given as ``batches``
        (:func:`~inkfw.bench.plan.interleaved_batches`): every run decodes each in turn, in
        ``runs``' order on even batches and reversed on odd ones; each run's outputs over all
        batches are then checked as one."""
        outputs: dict[str, list[list[int]]] = {r.name: [] for r in runs}
        for b, prompts in enumerate(batches):
            for run in round_order(runs, b):
                wall, outs = self._decode(run, set_name, prompts, max_new_tokens, cache_time)
                outputs[run.name] += outs
                self.decodes.setdefault((set_name, run.name), []).append((rep, sum(len(o) for o in outs), wall))
                self.on_decode()
        for run in runs:
            if run.system == "inkfw" and self.check is not None:
                self.check.add(set_name, run.batch_size, rep, run.name, outputs[run.name])
            tokens, wall = self.repeat_totals(set_name, run.name)[rep]
            self.console.print(
                f"  repeat {rep + 1}/{repeats} {set_name} {run.name}: {wall:.2f}s, "
                f"{tokens / wall if wall else 0.0:.1f} tokens/s{elapsed_since(self.started)}",
                markup=False,
                highlight=False,
            )
        reference = self.check.reference_outputs(set_name, 1, rep) if self.check is not None else None
        for run in runs:
            if run.system != "hf" or reference is None or len(reference) != len(outputs[run.name]):
                continue
            info = self.hf_vs_inkfw.setdefault(f"{set_name} {run.name}", {"requests": 0, "differ": 0})
            info["requests"] += len(outputs[run.name])
            info["differ"] += len(differing_requests(outputs[run.name], reference))

    def _decode(
        self, run: BenchRun, set_name: str, prompts: list[list[int]], max_new_tokens: int, cache_time: bool
    ) -> tuple[float, list[list[int]]]:
        """One measured decode of ``prompts`` by ``run`` (timings added to its totals)."""
        if run.system == "hf":
            assert self.hf is not None
            result = self.hf.generate(prompts, max_new_tokens, run.use_mtp)
            timing = self.hf_timings.setdefault((set_name, run.name), HfTiming())
            timing.wall_s += result.wall_s
            timing.tokens += result.tokens
            timing.num_requests += len(prompts)
            return result.wall_s, result.outputs
        requests = batch_requests(prompts, run.batch_size)
        return _measure(self.cases[run.engine_key], set_name, requests, max_new_tokens, cache_time)


# ------------------------------------------------------------------------ the run
def elapsed_since(started: float) -> str:
    """`` (at N s)``: the seconds since ``started`` (the bench's start), ending each progress line, so
    a run that ran out of time shows where its time went."""
    return f" (at {time.perf_counter() - started:.0f} s)"


def hf_load_kwargs(cfg: Any) -> dict[str, Any]:
    """``hf_load``: keyword arguments of the HF baselines' ``from_pretrained`` (a mapping; null
    values are left to HF)."""
    load = plain(cfg.get("hf_load")) or {}
    if not isinstance(load, dict) or not all(isinstance(k, str) for k in load):
        raise ConfigError(
            f"hf_load must map from_pretrained's argument names to values, e.g. "
            f"hf_load.experts_implementation=eager; got {load!r}."
        )
    return {str(k): v for k, v in load.items() if v is not None}


def run_bench(cfg: Any) -> dict[str, Any]:
    """Run the benchmark of ``cfg`` (``inkfw/conf/bench.yaml``); returns what ``bench.json`` holds.
    ``report["exactness"]["ok"]`` is False when greedy outputs differed (the script exits 1)."""
    started = time.perf_counter()
    console = Console()
    if not console.is_terminal:  # piped or logged: keep the table on one line per row
        console = Console(width=220)
    opts = bench_options(cfg)
    runs = opts.runs()
    seed = int_option(cfg.seed, "seed", 0)
    block_size = int_option(cfg.kv.block_size, "kv.block_size")
    if cfg.threads is not None:
        torch.set_num_threads(int_option(cfg.threads, "threads (null: torch's default)"))
    greedy = _greedy(cfg)
    mcfg = model_config(cfg.model)
    if opts.hf:
        if not cfg.model.get("path"):
            raise ConfigError(
                f"the HF baselines load a checkpoint, but model preset {cfg.model.get('name')!r} has no path; "
                f"give model=inkling model.path=DIR or hf=[]."
            )
        if not greedy:
            raise ConfigError("the HF baselines decode greedily; set sampler.temperature=0 or hf=[].")
        if "generate_mtp" in opts.hf and mcfg.mtp.num_nextn_predict_layers == 0:
            raise ConfigError("hf=generate_mtp needs MTP depths, but the checkpoint ships none.")
    device, dtype = resolve_device(cfg.device), parse_dtype(cfg.dtype)
    kernel_opts = kernel_bench_options(cfg, device)

    tokenizer = load_tokenizer(cfg.model)
    prompt_sets = {
        name: load_prompt_set(name, tokenizer, opts.num_prompts, mcfg.logits_vocab_size, opts.prompt_len, seed)
        for name in opts.prompt_sets
    }
    model = build_model(
        cfg.model, mtp_depths=cfg.mtp.depths, dtype=dtype, device=device, embed_source=cfg.mtp.embed_source
    )
    if any(r.drafter == "mtp" for r in runs) and model.num_mtp_depths == 0:
        raise ConfigError(f"drafter mtp needs MTP depths; model {cfg.model.get('name')!r} has none.")
    longest = max(len(p) for prompts in prompt_sets.values() for p in prompts)
    k_max = _max_draft_tokens(opts, cfg, model.num_mtp_depths)
    needed = longest + max(opts.max_new_tokens, opts.warmup_tokens) + k_max + block_size
    if needed > mcfg.max_position_embeddings:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + max_new_tokens ({opts.max_new_tokens}) leaves no room below "
            f"the model limit {mcfg.max_position_embeddings}."
        )
    max_model_len = shared_max_model_len(needed, mcfg.max_position_embeddings)
    console.print(
        f"model {cfg.model.get('path') or cfg.model.get('name')}: {mcfg.num_layers} layers, hidden "
        f"{mcfg.hidden_size}, {model.num_mtp_depths} MTP depths; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), device {device}; prompt sets "
        + ", ".join(f"{n} ({len(p)} prompts)" for n, p in prompt_sets.items()),
        markup=False,
    )

    forward = one_token_forward_report(model, opts.forward_ops, opts.forward_repeats)
    kernels = kernel_report(
        model,
        device,
        kernel_opts,
        opts.forward_repeats,
        block_size,
        progress=lambda line: console.print(line + elapsed_since(started), markup=False, highlight=False),
    )
    hf = (
        HfBaseline(
            resolve_path(cfg.model.path), dtype, device, mcfg.eos_token_ids, opts.ignore_eos, hf_load_kwargs(cfg)
        )
        if opts.hf
        else None
    )
    cases: dict[tuple, Case] = {}
    batches = {name: interleaved_batches(prompts, runs, opts.interleave) for name, prompts in prompt_sets.items()}
    with Progress(*Progress.get_default_columns(), MofNCompleteColumn(), console=console, transient=True) as progress:
        # first-call costs stay out of the measured runs: warm-up, then one short batch per prompt set
        first_runs: dict[tuple, BenchRun] = {}  # per engine key (an inkfw engine, an HF system): its first run
        for run in runs:
            first_runs.setdefault(run.engine_key, run)
        warming = progress.add_task("warm-up (compiles, step costs)", total=len(first_runs))
        for run in first_runs.values():
            if run.system == "inkfw":
                case = _build_case(cfg, opts, run, model, tokenizer, max_model_len)
                cases[run.engine_key] = case
                for prompts in prompt_sets.values() if opts.warmup_tokens else []:
                    warm = batch_requests(prompts[: run.batch_size], run.batch_size)
                    _generate(case.engine, warm, opts.warmup_tokens, run.name)
                progress.console.print(
                    f"  warm-up {run.name}: {case.warmup_s:.1f}s{elapsed_since(started)}", markup=False, highlight=False
                )
            elif run.system == "hf" and opts.warmup_tokens:
                assert hf is not None
                for prompts in prompt_sets.values():
                    hf.generate(prompts[:1], opts.warmup_tokens, run.use_mtp)
            progress.update(warming, advance=1)

        decodes = opts.repeats * len(runs) * sum(map(len, batches.values()))
        decoding = progress.add_task("measured decodes (every run, each slice in turn)", total=decodes)
        rounds = Rounds(
            console,
            cases,
            hf,
            ExactnessCheck() if greedy else None,
            lambda: progress.advance(decoding),
            started=started,
        )
        for rep in range(opts.repeats):
            order = round_order(runs, rep)
            for set_name in prompt_sets:
                rounds.measure(
                    rep, opts.repeats, set_name, batches[set_name], order, opts.max_new_tokens, opts.cache_time
                )
    check = rounds.check

    rows: list[dict[str, Any]] = []
    for set_name in prompt_sets:
        for run in runs:
            if run.system == "hf":
                rows.append(_hf_row(run, set_name, rounds.hf_timings[(set_name, run.name)]))
            else:
                rows.append(_inkfw_row(cases[run.engine_key], set_name))
            rows[-1]["repeat_tokens_per_s"] = rounds.repeat_tokens_per_s(set_name, run.name)
            rows[-1]["decodes"] = [[tokens, wall] for _, tokens, wall in rounds.decodes[(set_name, run.name)]]
    add_speedups(rows)
    add_repeat_ratios(rows)
    exactness = check.summary() if check is not None else unchecked_summary("sampling (temperature > 0)")
    report = {
        "config": OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "model": {
            "name": cfg.model.get("path") or cfg.model.get("name"),
            "num_layers": mcfg.num_layers,
            "hidden_size": mcfg.hidden_size,
            "vocab_size": mcfg.vocab_size,
            "mtp_depths": model.num_mtp_depths,
        },
        "prompt_sets": {
            n: {"num_prompts": len(p), "mean_prompt_tokens": sum(map(len, p)) / len(p)} for n, p in prompt_sets.items()
        },
        "max_new_tokens": opts.max_new_tokens,
        "ignore_eos": opts.ignore_eos,
        "repeats": opts.repeats,
        "interleave": opts.interleave,
        "one_token_forward": forward,
        "kernels": kernels,
        "results": rows,
        "exactness": exactness,
        "hf_vs_inkfw_greedy": rounds.hf_vs_inkfw,
    }
    console.print(bench_table(report))
    if kernels is not None:
        console.print(kernel_table(kernels))
        if not kernels["greedy_agree"]:
            console.print("[red]kernels: the Triton verify forward's argmax differs from the torch backend's[/red]")
    if opts.profile or opts.cache_time:
        console.print(overhead_table([r for r in rows if r["system"] == "inkfw"], opts.profile))
    if check is not None and check.ok:
        console.print(f"greedy exactness: {check.compared} runs equal their group's reference token for token")
    for m in check.mismatches if check is not None else []:
        console.print(f"[red]greedy outputs differ: {m.line()}[/red]")
    console.print(f"bench done{elapsed_since(started)}", markup=False, highlight=False)
    if cfg.output_dir:
        _write_outputs(console, opts, Path(str(cfg.output_dir)), report, cases)
    return report


def _write_outputs(
    console: Console, opts: BenchOptions, out: Path, report: dict[str, Any], cases: dict[tuple, Case]
) -> None:
    written = [
        write_json_atomic(out / "bench.json", report, "output_dir"),
        write_text_atomic(out / "bench.md", bench_markdown(report), "output_dir"),
    ]
    if opts.plot:
        inkfw_rows = [r for r in report["results"] if r["system"] == "inkfw"]
        plots = [
            (bench_plot, report, out / "bench.png"),
            (bench_acceptance_plot, report, out / "acceptance.png"),
            (overhead_plot, inkfw_rows, out / "overhead.png"),
        ]
        for plot, data, path in plots:
            if not plot(data, path):
                console.print("[yellow]matplotlib is not installed: no plots (pip install matplotlib)[/yellow]")
                break
            written.append(path)
    rows = {(r["prompt_set"], r["name"]): r for r in report["results"]}
    for case in cases.values():
        for set_name, profiler in case.profilers.items():
            path = out / f"profile-{set_name}-{case.run.name.replace(' ', '-')}.txt"
            text = profile_text(profiler.profiler, rows[(set_name, case.run.name)], opts.profile_lines)
            written.append(write_text_atomic(path, text, "output_dir"))
    console.print("wrote " + ", ".join(str(p) for p in written), markup=False, highlight=False)
