"""The engine benchmark run behind ``scripts/bench.py``: overhead, speed and cache memory.

For every batch size and drafter it builds one engine (the serving factory,
:func:`~inkfw.speculative.factory.build_engine`, around one shared random-init model), warms
it up on other prompts, then decodes ``max_new_tokens`` tokens for ``batch_size`` random
prompts, ``repeats`` times. The configurations run round-robin (repeat 1 of every
configuration, then repeat 2, ...), so a noisy machine slows them alike and their ratios stay
comparable.

Per configuration it reports, summed over the repeats (timed by :mod:`inkfw.bench.timing`,
rendered by :mod:`inkfw.reporting`):

* wall time of ``Engine.generate`` and tokens/s (generated tokens / wall);
* step time (``StepTimes.total_s``) and forward time (``StepTimes.forward_s``: time inside the
  model forwards the engine ran: target prefill/verify, MTP depths, logits);
* **overhead** = step time / forward time (the engine's own Python and tensor bookkeeping);
* the step split draft / verify / bookkeeping, each also without its forwards;
* mean acceptance length tau, and the KV pool's bytes (``kv.nbytes``).

Forward time includes the paged cache's reads and writes that the layers do inside a forward
(``update_kv`` / ``conv_window``). ``cache_time=true`` times those apart
(``cache_in_forward_s``) and reports ``overhead_ratio_model_only`` = step time / (forward time
minus that), a stricter view of the engine's cost.

The options are infer's (``model``, ``drafter``, ``verifier``, ``sampler``, ``kv``, ``engine``,
``mtp.depths``, ``spec.num_tokens``, ...) plus the benchmark's own (``inkfw/conf/bench.yaml``).
``drafters`` names the ``inkfw/conf/drafter`` options to compare; the one ``drafter=`` selects keeps
its ``drafter.*`` overrides. ``engine.max_num_seqs`` and ``engine.max_model_len`` are set per
configuration (the batch size; prompt + tokens + k + one block).

Measuring only: nothing here changes what the engine computes. Speed and memory are measured
here, never in timed tests.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf, open_dict
from rich.console import Console

from inkfw.bench.timing import CacheTimer, CaseTiming, PhaseForwardTimer, ProfilerPause, profile_text
from inkfw.errors import ConfigError
from inkfw.paths import config_dir
from inkfw.presets import build_model, plain
from inkfw.reporting import (
    OVERHEAD_TARGET,
    bench_comparison_lines,
    bench_markdown,
    bench_plot,
    bench_table,
    write_json_atomic,
    write_text_atomic,
)
from inkfw.speculative.engine import Engine, StepTimes
from inkfw.speculative.factory import build_engine, drafter_kind, serving_config
from inkfw.speculative.metrics import SpecMetrics


@dataclass
class Case:
    """One configuration: its engine, the observers timing it, and its summed runs."""

    engine: Engine
    forwards: PhaseForwardTimer
    timing: CaseTiming
    profiler: ProfilerPause | None = None

    @property
    def name(self) -> str:
        return f"{self.timing.drafter}/b{self.timing.batch_size}"


# ------------------------------------------------------------------------ options
def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _positive_ints(values: Any, what: str) -> list[int]:
    values = plain(values)
    out = list(values) if isinstance(values, (list, tuple)) else [values]
    if not out or not all(_is_count(v) for v in out):
        raise ConfigError(f"{what} must be a list of integers >= 1, got {values!r}.")
    return out


def _positive_int(value: Any, what: str) -> int:
    if not _is_count(value):
        raise ConfigError(f"{what} must be an integer >= 1, got {value!r}.")
    return value


def drafter_options() -> list[str]:
    """The ``inkfw/conf/drafter`` options a benchmark can compare."""
    return sorted(p.stem for p in (config_dir() / "drafter").glob("*.yaml"))


def _drafter_names(value: Any) -> list[str]:
    value = plain(value)
    names = list(value) if isinstance(value, (list, tuple)) else [value]
    options = drafter_options()
    if not names or any(d not in options for d in names):
        raise ConfigError(f"drafters must be a list drawn from {', '.join(options)}, got {names!r}.")
    return names


def _drafter_node(cfg: Any, name: str) -> Any:
    """The ``inkfw/conf/drafter/<name>`` node; the one ``drafter=`` selected keeps its overrides."""
    if drafter_kind(cfg.get("drafter")) == name:
        return cfg.drafter
    return serving_config([f"drafter={name}"]).drafter


def _case_config(cfg: Any, drafter: Any, batch_size: int, max_model_len: int) -> Any:
    case = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(case):
        case.drafter = drafter
        case.engine.max_num_seqs = batch_size
        case.engine.max_model_len = max_model_len
    return case


# ------------------------------------------------------------------------ runs
def _build_case(cfg: Any, model, drafter: str, batch_size: int, max_model_len: int) -> Case:
    engine, _ = build_engine(_case_config(cfg, _drafter_node(cfg, drafter), batch_size, max_model_len), model=model)
    if bool(cfg.ignore_eos):  # random weights: never stop early, every run decodes the same count
        engine.eos_ids = set()
    forwards = PhaseForwardTimer()
    engine.add_observer(forwards)
    profiler = None
    if bool(cfg.profile):
        profiler = ProfilerPause(cProfile.Profile())
        engine.add_observer(profiler)
    timing = CaseTiming(drafter, batch_size, int(engine.drafter.num_tokens))
    return Case(engine, forwards, timing, profiler)


def _prompts(gen: torch.Generator, batch: int, length: int, vocab: int) -> list[list[int]]:
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def _generate(case: Case, prompts: list[list[int]], max_new_tokens: int) -> tuple[float, list[list[int]]]:
    eng = case.engine
    params = eng.sampler.defaults  # inkfw/conf/sampler: greedy unless told otherwise
    reqs = [eng.add_request(p, params, max_new_tokens=max_new_tokens) for p in prompts]
    t0 = time.perf_counter()
    eng.generate(reqs)
    wall = time.perf_counter() - t0
    bad = [r for r in reqs if r.finish_reason == "error"]
    if bad:
        raise ConfigError(f"{case.name}: request failed: {bad[0].error}")
    return wall, [r.output_token_ids for r in reqs]


def _measure(
    case: Case, prompts: list[list[int]], max_new_tokens: int, cache_time: bool
) -> tuple[float, float, list[list[int]]]:
    """One measured run of ``case`` (its statistics start from zero and are added to its
    timing): (wall seconds, overhead ratio, output token ids)."""
    engine = case.engine
    engine.times, engine.metrics = StepTimes(), SpecMetrics()
    case.forwards.reset()
    timer = CacheTimer()
    with (
        timer.attached(engine.kv) if cache_time else contextlib.nullcontext(),
        case.profiler.profiling() if case.profiler is not None else contextlib.nullcontext(),
    ):
        wall, outs = _generate(case, prompts, max_new_tokens)
    ratio = case.timing.add_run(
        wall,
        sum(len(o) for o in outs),
        engine.times,
        engine.metrics,
        case.forwards,
        timer.seconds if cache_time else None,
    )
    return wall, ratio, outs


def run_bench(cfg: Any) -> dict[str, Any]:
    console = Console()
    if not console.is_terminal:  # piped or logged: keep the table on one line per row
        console = Console(width=200)
    batch_sizes = _positive_ints(cfg.batch_sizes, "batch_sizes")
    drafters = _drafter_names(cfg.drafters)
    for name in ("prompt_len", "max_new_tokens", "repeats"):
        _positive_int(cfg[name], name)
    block_size = _positive_int(cfg.kv.block_size, "kv.block_size")
    if not isinstance(cfg.warmup_tokens, int) or cfg.warmup_tokens < 0:
        raise ConfigError(f"warmup_tokens must be an integer >= 0, got {cfg.warmup_tokens!r}.")
    if cfg.spec.num_tokens is not None:
        _positive_int(cfg.spec.num_tokens, "spec.num_tokens")
    if cfg.threads is not None:
        torch.set_num_threads(_positive_int(cfg.threads, "threads"))

    model = build_model(
        cfg.model, mtp_depths=cfg.mtp.depths, dtype=cfg.dtype, device=cfg.device, embed_source=cfg.mtp.embed_source
    )
    mcfg = model.cfg
    if "mtp" in drafters and model.num_mtp_depths == 0:
        raise ConfigError(f"drafter mtp needs MTP depths; model preset {cfg.model.get('name')!r} built none.")
    prompt_len, new = int(cfg.prompt_len), int(cfg.max_new_tokens)
    k = model.num_mtp_depths if cfg.spec.num_tokens is None else int(cfg.spec.num_tokens)
    max_model_len = prompt_len + max(new, int(cfg.warmup_tokens)) + k + block_size
    if max_model_len > mcfg.max_position_embeddings:
        raise ConfigError(
            f"prompt_len + max_new_tokens ({prompt_len + new}) leaves no room below the model limit "
            f"{mcfg.max_position_embeddings}."
        )
    gen = torch.Generator().manual_seed(int(cfg.seed))
    vocab = mcfg.logits_vocab_size

    cases = [_build_case(cfg, model, d, b, max_model_len) for b in batch_sizes for d in drafters]
    console.print(
        f"model {cfg.model.get('name')}: {mcfg.num_layers} layers, hidden {mcfg.hidden_size}, "
        f"vocab {mcfg.vocab_size}, {model.num_mtp_depths} MTP depths; torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), device {cfg.device}"
    )
    if int(cfg.warmup_tokens) > 0:
        for case in cases:
            _generate(case, _prompts(gen, case.timing.batch_size, prompt_len, vocab), int(cfg.warmup_tokens))
    mismatches: dict[int, int] = {b: 0 for b in batch_sizes}  # greedy: every drafter must emit the same tokens
    for rep in range(int(cfg.repeats)):
        prompts_for = {b: _prompts(gen, b, prompt_len, vocab) for b in batch_sizes}  # same prompts per drafter
        outputs: dict[int, list[list[int]]] = {}
        for case in cases:
            b = case.timing.batch_size
            wall, ratio, outs = _measure(case, prompts_for[b], new, bool(cfg.cache_time))
            first = outputs.setdefault(b, outs)
            mismatches[b] += sum(x != y for x, y in zip(first, outs))
            console.print(f"  repeat {rep + 1}/{cfg.repeats} {case.name}: {wall:.2f}s, overhead {ratio:.3f}")

    results = [c.timing.result(c.engine.kv.nbytes) for c in cases]
    for r in results:
        r["greedy_output_mismatches"] = mismatches[r["batch_size"]]
    console.print(bench_table(results, bool(cfg.profile)))
    for line in bench_comparison_lines(results):
        console.print(line)

    report = {
        "config": OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
        },
        "model": {
            "name": cfg.model.get("name"),
            "num_layers": mcfg.num_layers,
            "hidden_size": mcfg.hidden_size,
            "vocab_size": mcfg.vocab_size,
            "mtp_depths": model.num_mtp_depths,
        },
        "overhead_target": OVERHEAD_TARGET,
        "results": results,
    }
    if cfg.output_dir:
        _write_outputs(console, cfg, Path(str(cfg.output_dir)), report, cases)
    return report


def _write_outputs(console: Console, cfg: Any, out: Path, report: dict[str, Any], cases: list[Case]) -> None:
    results = report["results"]
    written = [
        write_json_atomic(out / "bench.json", report, "output_dir"),
        write_text_atomic(out / "bench.md", bench_markdown(results), "output_dir"),
    ]
    if cfg.plot and bench_plot(results, out / "bench.png"):
        written.append(out / "bench.png")
    elif cfg.plot:
        console.print("[yellow]matplotlib is not installed: no plot (pip install matplotlib)[/yellow]")
    for case, result in zip(cases, results):
        if case.profiler is not None:
            path = out / f"profile-{case.name.replace('/', '-')}.txt"
            write_text_atomic(path, profile_text(case.profiler.profiler, result, int(cfg.profile_lines)), "output_dir")
            written.append(path)
    console.print("wrote " + ", ".join(str(p) for p in written))
