"""Profiling of the model's hot path: top-level aten op counts and eager wall time.

The serving step on a small model is bound by how many operators it dispatches, not by
arithmetic. :func:`count_aten_ops` counts the *top-level* aten operators a call issues, as
``torch.profiler`` records them: an ``aten::`` op that no other ``aten::`` op called (so
``aten::linear`` counts once, not with the ``aten::t`` and ``aten::addmm`` it runs inside).
:func:`one_token_forwards` builds the 1-token forwards the engine and the tests run (uncached,
dense cache, paged cache) so that ``scripts/count_ops.py`` and the benchmark measure the same thing.
:func:`count_host_reads` counts calls that move tensor data to the host (``item``, ``tolist``,
``bool()``, ...), for the engine's budget of one device->host read per decode step.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def _is_top_level_aten(event) -> bool:
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def quiet_profile(**kwargs: Any) -> profile:
    """``torch.profiler.profile(**kwargs)`` without kineto's two ``USDT: ... profiler_start`` /
    ``profiler_stop`` lines on stderr per profiled block, unless ``KINETO_LOG_LEVEL`` is set.
    Kineto reads the level once, at the process's first profile."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # above its highest level: nothing printed
    return profile(**kwargs)


def aten_op_histogram(fn: Callable[[], Any], nested: bool = False) -> Counter[str]:
    """Aten ops one call of ``fn()`` issues (under ``torch.no_grad``), by name (``aten::mm``):
    the top-level ones, or with ``nested`` every op including those other ops call."""
    with torch.no_grad(), quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(
        e.name for e in prof.events() or [] if e.name.startswith("aten::") and (nested or _is_top_level_aten(e))
    )


def count_aten_ops(fn: Callable[[], Any], nested: bool = False) -> int:
    """Number of top-level aten ops (all aten ops with ``nested``) one call of ``fn()`` issues."""
    return sum(aten_op_histogram(fn, nested).values())


def timed_calls(
    fn: Callable[[], Any], repeats: int = 50, warmup: int = 5, device: torch.device | None = None
) -> tuple[float, Any]:
    """(median seconds of one ``fn()`` call over ``repeats`` calls after ``warmup`` calls, what the
    first timed call returned): CUDA events around each call on a CUDA ``device`` (one synchronize
    at the end), ``perf_counter`` elsewhere."""
    on_cuda = device is not None and device.type == "cuda"
    mark: Callable[[], Any] = _cuda_mark if on_cuda else time.perf_counter
    first: Any = None
    with torch.no_grad():
        for _ in range(warmup):
            fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        marks = []
        for i in range(repeats):
            start = mark()
            out = fn()
            marks.append((start, mark()))
            first = out if i == 0 else first
        if on_cuda:
            torch.cuda.synchronize(device)
    times = sorted(s.elapsed_time(e) / 1e3 if on_cuda else e - s for s, e in marks)
    return times[len(times) // 2], first


def _cuda_mark() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def wall_time(fn: Callable[[], Any], repeats: int = 50, warmup: int = 5) -> float:
    """Median seconds of one ``fn()`` call over ``repeats`` calls (after ``warmup`` calls)."""
    return timed_calls(fn, repeats, warmup)[0]


HOST_READ_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "to")


@dataclass(eq=False)
class HostReads:
    """Host reads counted by :func:`count_host_reads`: ``count`` in all, ``by_kind`` per method name."""

    count: int = 0
    by_kind: Counter[str] = field(default_factory=Counter)


_active: list[HostReads] = []  # counters of the open count_host_reads() blocks, outermost first
_in_read = False  # inside a counted call: reads it makes itself (numpy() in __array__) do not count again


def _to_reads_host(tensor: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    """Whether ``tensor.to(*args, **kwargs)`` copies from a non-CPU device to the CPU."""
    target = kwargs.get("device")
    if target is None and args:
        target = args[0].device if isinstance(args[0], torch.Tensor) else args[0]
    if not isinstance(target, str | torch.device | int) or isinstance(target, bool):
        return False  # a dtype, or no device at all
    return torch.device(target).type == "cpu" and tensor.device.type != "cpu"


def _counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        global _in_read
        if _in_read or (name == "to" and not _to_reads_host(self, args, kwargs)):
            return original(self, *args, **kwargs)
        for reads in _active:
            reads.count += 1
            reads.by_kind[name] += 1
        _in_read = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _in_read = False

    return method


@contextlib.contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count calls that bring tensor data to the host while the block runs.

    Patches ``torch.Tensor`` methods ``item``, ``tolist``, ``__bool__``, ``__int__``, ``__float__``,
    ``__index__``, ``cpu`` and ``numpy`` (every call counts, also on a CPU-only machine, where no
    copy happens: conservative) and ``to`` (only a copy from a non-CPU device to the CPU counts:
    moving host-built tensors to the device is no read). A call that reads through another
    patched method counts once. Blocks nest: each counts the reads made while it is open; the
    patches are removed when the outermost block exits, also on an exception. Not thread-safe.
    """
    reads = HostReads()
    saved = {}
    if not _active:
        for name in HOST_READ_METHODS:
            saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, _counting(name, getattr(torch.Tensor, name)))
    _active.append(reads)
    try:
        yield reads
    finally:
        _active.remove(reads)
        for name, original in saved.items():  # only the outermost block saved anything
            if original is None:
                delattr(torch.Tensor, name)  # the method is inherited from torch._C.TensorBase
            else:
                setattr(torch.Tensor, name, original)


def one_token_forwards(model, context: int = 32, seed: int = 0) -> dict[str, Callable[[], Any]]:
    """1-token forwards of ``model`` at position ``context`` (after a ``context``-token prefill):

    * ``uncached``: ``model(ids, positions)`` on the one token alone;
    * ``dense``: through a :class:`~inkfw.cache.dense.DenseModelCache`;
    * ``paged``: through the engine's :class:`~inkfw.cache.paged.PagedKVManager`, building the
      per-forward cache views as the verifier does (``paged_model`` times the model alone on
      views built once).

    Each callable rewrites the same position, so it can be called any number of times.
    """
    from inkfw.cache.dense import DenseModelCache
    from inkfw.cache.paged import PagedKVManager
    from inkfw.speculative.step import table_width

    param = next(model.parameters())
    device = param.device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.cfg.logits_vocab_size, (1, context + 1), generator=gen).to(device)
    ids, positions = prompt[:, context:], torch.full((1, 1), context, device=device)  # [1, 1]
    prefix_positions = torch.arange(context, device=device)[None]  # [1, context]

    dense = DenseModelCache(model, batch=1, max_len=context + 8)
    kv = PagedKVManager(model, block_size=16, max_model_len=context + 8, max_num_seqs=1, enable_prefix_caching=False)
    kv.add("r", prompt[0].tolist())
    kv.ensure("r", target_end=context + 1, draft_end=0)
    valid_prefix = torch.ones_like(prefix_positions, dtype=torch.bool)
    valid = torch.ones_like(positions, dtype=torch.bool)
    with torch.no_grad():
        model(prompt[:, :context], prefix_positions, dense.layers)
        model(prompt[:, :context], prefix_positions, kv.target_caches(["r"], prefix_positions, valid_prefix))

    def paged_views():  # as the verifier builds them: block tables from host values, views from tensors
        tables = kv.step_tables(kv.group_indices(), ["r"], [context], [context + 1], width=table_width)
        return kv.caches_from(tables, positions, valid)

    views = paged_views()

    return {
        "uncached": lambda: model(ids, positions),
        "dense": lambda: model(ids, positions, dense.layers),
        "paged": lambda: model(ids, positions, paged_views()),
        "paged_model": lambda: model(ids, positions, views),
    }


FORWARD_MODES = ("uncached", "dense", "paged", "paged_model")


def report_one_token_ops(cfg: Any) -> dict[str, dict[str, float]]:
    """``scripts/count_ops.py``: top-level (and nested) aten ops and median eager wall time of a
    1-token forward of ``cfg.model`` in each of ``cfg.modes``; prints a table, returns
    ``{mode: {"top_level_ops", "nested_ops", "wall_ms"}}``."""
    from rich.console import Console
    from rich.table import Table

    from inkfw.errors import ConfigError
    from inkfw.options import int_option, optional_int_option
    from inkfw.presets import build_model

    modes = list(cfg.modes)
    unknown = [m for m in modes if m not in FORWARD_MODES]
    if not modes or unknown:
        raise ConfigError(f"modes must be a non-empty list of {', '.join(FORWARD_MODES)}; got {modes}.")
    context, repeats = int_option(cfg.context, "context"), int_option(cfg.repeats, "repeats")
    threads = optional_int_option(cfg.threads, "threads")
    if threads is not None:
        torch.set_num_threads(threads)
    model = build_model(cfg.model, mtp_depths=cfg.mtp.depths, dtype=cfg.dtype, device=cfg.device)
    if context + 1 > model.cfg.max_position_embeddings:
        raise ConfigError(
            f"context {context} leaves no position for the token "
            f"(max_position_embeddings={model.cfg.max_position_embeddings})."
        )
    forwards = one_token_forwards(model, context=context)
    results = {}
    for mode in modes:
        fn = forwards[mode]
        results[mode] = {
            "top_level_ops": count_aten_ops(fn),
            "nested_ops": count_aten_ops(fn, nested=True),
            "wall_ms": 1e3 * wall_time(fn, repeats=repeats),
        }
    table = Table(
        title=f"1-token forward of {cfg.model.get('path') or cfg.model.name} at position {context} "
        f"({torch.get_num_threads()} threads)"
    )
    for column in ("forward", "top-level aten ops", "all aten ops", "eager ms (median)"):
        table.add_column(column, justify="left" if column == "forward" else "right")
    for mode, r in results.items():
        table.add_row(mode, str(r["top_level_ops"]), str(r["nested_ops"]), f"{r['wall_ms']:.2f}")
    Console().print(table)
    return results
