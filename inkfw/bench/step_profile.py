"""Where a decode step's time goes: ``scripts/profile_step.py`` (``inkfw/conf/profile_step.yaml``).

The engine is built as ``scripts/infer.py`` builds it (the same config groups and options,
e.g. ``spec.num_tokens=8 engine.compile=true``) and warmed up
(:meth:`Engine.warmup`: compiles with ``engine.compile=true``). A batch of prompts is prefilled
unprofiled; then ``steps`` decode steps run under ``torch.profiler``. With compile on, inductor's
generated CPU kernels appear by name (``torch._inductor.config.cpp.enable_kernel_profile``).
On CUDA the GPU's kernels are recorded too (:func:`gpu_kernels`: per step, how many ran, CUDA
graphs' included, their milliseconds and the share of the wall time the GPU was busy).

Reported per decode step (:func:`step_parts`): wall time, split by the self time of what ran
into matmuls, attention, inductor's fused kernels, compiled-graph glue, dynamo's guard checks,
other aten ops, and the host time outside every profiled op (Python: scheduling, staging,
bookkeeping); and the ops that cost most. Profiled times run somewhat slower than unprofiled ones.
Counted on as many decode steps before the profile (:class:`OpsOutsideSteps`): the aten ops issued
outside the step functions, which a GPU runs eagerly beside the CUDA graphs, and those inside.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from inkfw.errors import ConfigError
from inkfw.options import bool_option, int_option, optional_int_option
from inkfw.profiling import quiet_profile
from inkfw.speculative.step import StepFunction

# (part, does an event of this name belong to it); the first match wins, the rest is "other aten ops"
PARTS: tuple[tuple[str, Any], ...] = (
    ("matmuls (aten::mm, addmm, bmm)", lambda n: n in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
    ("attention (SDPA)", lambda n: "scaled_dot_product" in n and not n.startswith("graph_")),
    ("inductor fused kernels", lambda n: "cpp_fused" in n or "triton_" in n),
    (
        "compiled-graph glue",
        lambda n: n.startswith(("## Call CompiledFxGraph", "Torch-Compiled Region", "AOTDispatcher")),
    ),
    ("dynamo guards + bytecode", lambda n: n in ("TorchDynamo Cache Lookup", "Pregraph bytecode")),
)
OTHER_OPS = "other ops"
HOST = "host, outside any op (Python)"


def part_of(name: str) -> str:
    for part, matches in PARTS:
        if matches(name):
            return part
    return OTHER_OPS


def step_parts(events: Iterable[tuple[str, int, float]], wall_s: float, steps: int) -> dict[str, float]:
    """Milliseconds per step of each part: ``events`` are (name, calls, self seconds) summed over
    the profiled ``steps``, ``wall_s`` their wall time; the host part is what no op accounts for."""
    ms = {part: 0.0 for part, _ in PARTS} | {OTHER_OPS: 0.0}
    for name, _, self_s in events:
        ms[part_of(name)] += 1e3 * self_s / steps
    ms[HOST] = max(0.0, 1e3 * wall_s / steps - sum(ms.values()))
    return ms


def per_step_rows(entries: Iterable[tuple[str, int, float]], steps: int) -> list[dict[str, Any]]:
    """Rows of (name, calls, seconds) summed over ``steps`` steps, per step: calls, us per call
    and ms (entries never called are left out)."""
    return [
        {"name": n, "calls_per_step": c / steps, "us_per_call": 1e6 * s / c, "ms_per_step": 1e3 * s / steps}
        for n, c, s in entries
        if c
    ]


def gpu_kernels(kernels: Iterable[tuple[str, int, float]], wall_s: float, steps: int, top: int) -> dict[str, Any]:
    """Per step, of the GPU kernels that ran (``kernels``: (name, calls, device seconds) summed
    over ``steps`` profiled steps of ``wall_s`` seconds), CUDA graphs' included: how many, their
    milliseconds, the share of the wall time the GPU was busy, and the ``top`` costliest."""
    kernels = sorted(kernels, key=lambda k: -k[2])
    busy_ms = 1e3 * sum(s for _, _, s in kernels) / steps
    return {
        "kernels_per_step": sum(c for _, c, _ in kernels) / steps,
        "kernel_ms_per_step": busy_ms,
        "busy_share": busy_ms / (1e3 * wall_s / steps) if wall_s > 0 else 0.0,
        "top": per_step_rows(kernels[:top], steps),
    }


def _is_decoding(request) -> bool:
    return request.num_computed >= len(request.token_ids) - 1


class OpsOutsideSteps(TorchDispatchMode):
    """Counts the aten ops issued outside the step functions (:class:`StepFunction`): on a GPU
    they run eagerly, beside the CUDA graphs (staging, slicing, bookkeeping), each a launch and
    its dispatch; and those issued inside them, except in compiled steps (``inside`` None): dynamo
    cannot trace under a dispatch mode, so they run outside this one. While counting,
    step-function calls are marked (nothing is added to them otherwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.outside: Counter[str] = Counter()
        self.inside: int | None = 0
        self._running = 0  # step-function calls in progress

    def __enter__(self):
        call = self._call = StepFunction.__call__

        def marked(step: StepFunction, *args: torch.Tensor) -> Any:
            self._running += 1
            try:
                if step.compiled:  # its ops uncounted: dynamo refuses to trace under a dispatch mode
                    self.inside = None
                    with _disable_current_modes():
                        return call(step, *args)
                return call(step, *args)
            finally:
                self._running -= 1

        StepFunction.__call__ = marked  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        StepFunction.__call__ = self._call  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._running:
            if self.inside is not None:
                self.inside += 1
        else:
            self.outside[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def profile_decode_steps(
    engine, prompts: list[list[int]], steps: int, max_new_tokens: int, by_shape: bool = False
) -> dict[str, Any]:
    """Prefill ``prompts`` unprofiled, count the ops of up to ``steps`` decode steps (those outside
    the step functions by name), then profile up to ``steps`` more; aborts what is left.
    ``events`` are (op, calls, self seconds); ``by_shape``: input shapes recorded, one event per
    op and shapes, and ``listed`` names those ``op [shapes]`` (else it is ``events``)."""
    engine.eos_ids = set()  # every request runs to its length
    requests = [engine.add_request(p, max_new_tokens=max_new_tokens) for p in prompts]
    while not all(_is_decoding(r) for r in requests):
        engine.step()
    counted, ops = 0, OpsOutsideSteps()
    with torch.no_grad(), ops:
        while counted < steps and any(not r.finished for r in requests):
            engine.step()
            counted += 1
    done, activities = 0, [torch.profiler.ProfilerActivity.CPU]
    cuda = engine.device.type == "cuda"
    if cuda:  # the kernels too, CUDA graphs' included
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with quiet_profile(activities=activities, record_shapes=by_shape) as prof:
        t0 = time.perf_counter()
        while done < steps and any(not r.finished for r in requests):
            engine.step()
            done += 1
        if cuda:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - t0
    for r in requests:
        engine.abort(r)
    if done == 0:
        raise ConfigError("no decode step ran: raise max_new_tokens.")
    averages = prof.key_averages(group_by_input_shape=by_shape)
    on_gpu = [e for e in averages if e.device_type == torch.profiler.DeviceType.CUDA]
    on_cpu = [e for e in averages if e not in on_gpu]
    events = [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in on_cpu]
    listed = [(_with_shapes(e), c, s) for e, (_, c, s) in zip(on_cpu, events)] if by_shape else events
    kernels = [(e.key, e.count, e.self_device_time_total / 1e6) for e in on_gpu] if cuda else None
    outside = {
        "steps": counted,
        "outside_per_step": sum(ops.outside.values()) / max(1, counted),
        "inside_per_step": None if ops.inside is None else ops.inside / max(1, counted),
        "outside_by_op": {name: n / max(1, counted) for name, n in ops.outside.most_common()},
    }
    return {"steps": done, "wall_s": wall_s, "events": events, "listed": listed, "ops": outside, "kernels": kernels}


def _with_shapes(event: Any) -> str:
    """The op's name with its recorded input shapes after it: ``aten::mm [[9, 128], [128, 1024]]``."""
    shapes = [s for s in event.input_shapes if s]
    return f"{event.key} {shapes}" if shapes else event.key


def report_step_profile(cfg: Any) -> dict[str, Any]:
    """``scripts/profile_step.py``: prints the parts of a decode step and its costliest ops;
    returns (and with ``output`` writes as JSON) ``{"steps", "step_ms", "parts_ms", "top_ops", ...}``."""
    from omegaconf import open_dict

    from inkfw.bench.prompt_sets import batch_requests, load_prompt_set
    from inkfw.reporting import write_json_atomic
    from inkfw.speculative.factory import build_engine

    for name in ("steps", "batch_size", "max_new_tokens", "top"):
        int_option(cfg[name], name)
    by_shape = bool_option(cfg.shapes, "shapes")
    compiled = bool_option(cfg.engine.compile, "engine.compile")
    threads = optional_int_option(cfg.threads, "threads")
    if threads is not None:
        torch.set_num_threads(threads)
    with open_dict(cfg):
        cfg.engine.max_num_seqs = cfg.batch_size
    if compiled:  # name inductor's kernels in the profile (set before anything compiles)
        import torch._inductor.config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    engine, tokenizer = build_engine(cfg)
    engine.warmup([cfg.batch_size])
    prompts = load_prompt_set(
        cfg.prompt_set, tokenizer, cfg.batch_size, engine.vocab_size, prompt_len=cfg.prompt_len, seed=0
    )
    run = profile_decode_steps(
        engine, batch_requests(prompts, cfg.batch_size), cfg.steps, cfg.max_new_tokens, by_shape=by_shape
    )
    steps, events = run["steps"], run["events"]
    parts = step_parts(events, run["wall_s"], steps)
    top = sorted(run["listed"], key=lambda e: -e[2])[: cfg.top]
    result = {
        "engine": _engine_summary(cfg, engine.cuda_graphs),
        "batch_size": cfg.batch_size,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "step_ms": 1e3 * run["wall_s"] / steps,
        "parts_ms": parts,
        "aten_ops": run["ops"],
        "top_ops": per_step_rows(top, steps),
        "gpu": None if run["kernels"] is None else gpu_kernels(run["kernels"], run["wall_s"], steps, cfg.top),
    }
    _print(result)
    if cfg.output:
        write_json_atomic(str(cfg.output), result, option="output")
    return result


def _engine_summary(cfg: Any, cuda_graphs: bool) -> str:
    from inkfw.speculative.factory import drafter_kind

    kind = drafter_kind(cfg.drafter)
    k = cfg.spec.num_tokens if kind != "none" else None
    mode = ("compiled" if cfg.engine.compile else "eager") + (", CUDA graphs" if cuda_graphs else "")
    return f"{kind}{'' if k is None else f' k={k}'}, {mode}"


def _print(result: dict[str, Any]) -> None:
    console = Console()
    title = (
        f"decode step, {result['engine']}, batch {result['batch_size']}, "
        f"{result['threads']} thread(s): {result['step_ms']:.2f} ms over {result['steps']} steps (profiled)"
    )
    parts = Table(title=title)
    parts.add_column("part")
    parts.add_column("ms / step", justify="right")
    parts.add_column("share", justify="right")
    for part, ms in result["parts_ms"].items():
        parts.add_row(part, f"{ms:.2f}", f"{100 * ms / result['step_ms']:.0f} %")
    console.print(parts)
    counts = result["aten_ops"]
    top = ", ".join(f"{name} {n:.1f}" for name, n in list(counts["outside_by_op"].items())[:6])
    inside = "uncounted (compiled)" if counts["inside_per_step"] is None else f"{counts['inside_per_step']:.1f}"
    console.print(
        f"aten ops per decode step over {counts['steps']} steps: {counts['outside_per_step']:.1f} outside the step "
        f"functions (eager beside CUDA graphs: {top}), {inside} inside them",
        markup=False,
        highlight=False,
    )
    console.print(_rows_table("costliest ops (self time)", "op", result["top_ops"], ms_digits=2))
    gpu = result["gpu"]
    if gpu is not None:
        title = (
            f"GPU kernels: {gpu['kernels_per_step']:.0f} per step, {gpu['kernel_ms_per_step']:.2f} ms per step "
            f"({100 * gpu['busy_share']:.0f} % of the wall time)"
        )
        console.print(_rows_table(title, "kernel", gpu["top"], ms_digits=3))


def _rows_table(title: str, what: str, rows: list[dict[str, Any]], ms_digits: int) -> Table:
    """A table of :func:`per_step_rows` rows, long names cut to 72 characters."""
    table = Table(title=title)
    for column in (what, "calls / step", "µs / call", "ms / step"):
        table.add_column(column, justify="left" if column == what else "right")
    for row in rows:
        name = row["name"] if len(row["name"]) <= 72 else row["name"][:69] + "..."
        table.add_row(
            name, f"{row['calls_per_step']:.1f}", f"{row['us_per_call']:.1f}", f"{row['ms_per_step']:.{ms_digits}f}"
        )
    return table
