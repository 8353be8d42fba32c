"""CUDA graphs on the CPU, with the semantics that matter for correctness.

A real CUDA graph records the kernels one call of a function launches; ``replay()`` re-launches
them on the same memory and never runs the function's Python again. Whatever the function read
from Python state (a counter, a list, a shape picked by an ``if``) is baked in at capture; every
intermediate and output lives at a fixed address that each replay overwrites; and a host read
(``.item()``, ``bool(tensor)``, ``nonzero``) or a host->device copy during capture is an error.

:class:`RecordedCudaGraphs` patches ``torch.cuda``'s stream and graph API so that
:class:`~inkfw.speculative.step.StepFunction`'s own capture code runs on the CPU:

* ``with torch.cuda.graph(g):`` runs the function under a dispatch mode that records every aten
  op with its arguments (the capture-time tensors themselves) and refuses host reads and tensors
  made from host data. The capture run's writes are undone on exit (a real capture runs nothing).
* A Triton kernel (``kernels.backend=triton``, run by Triton's interpreter on the CPU) is
  recorded as one launch: its ``inkfw.kernels`` function with its arguments, as a graph records
  the kernels it launches (the interpreter's own copies to and from the host stay out of the
  record). Its tensor arguments' storages are kept for undo, as any of them may be written.
* ``engine.cuda_graphs=true`` is accepted on the CPU.
* ``g.replay()`` re-runs the recorded ops and launches in order on those same tensors, writing
  each one's result into the tensor the capture produced, so later ops, the graph's outputs and
  anything Python kept from the capture all see the replay's values, and no step's Python runs.

So a step function that is only correct because Python re-runs it fails here as on a GPU; the
older simulation (re-running the function on each replay) could not see that. Eager functions
only: a compiled function's C++ kernels bypass the dispatcher.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import inkfw.kernels as kernels_module
import inkfw.speculative.engine as engine_module

aten = torch.ops.aten

# ops a CUDA graph capture cannot contain: host reads (a sync) and tensors made from host data
# (a host->device copy), as torch raises for them while a stream captures
NOT_CAPTURABLE = {
    aten._local_scalar_dense.default: "reads a value back to the host (.item(), bool(), int())",
    aten.nonzero.default: "has a data-dependent shape (nonzero syncs with the host)",
    aten.lift_fresh.default: "makes a tensor from host data (torch.tensor([...]) copies host->device)",
}


class CaptureError(AssertionError):
    """A step function did something during capture that a CUDA graph cannot record."""


def _refuse(name: str, func: Any, args: tuple) -> None:
    scalar = func is aten.lift_fresh.default and args[0].dim() == 0  # t[i] = 1.0: a scalar kernel argument
    if func in NOT_CAPTURABLE and not scalar:
        raise CaptureError(f"{name}: {func} {NOT_CAPTURABLE[func]} inside a captured step")


class _Refusing(TorchDispatchMode):
    """Runs ops, refusing what a capture cannot contain (:data:`NOT_CAPTURABLE`)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        _refuse(self.name, func, args)
        return func(*args, **(kwargs or {}))


class _Recorder(TorchDispatchMode):
    """Records each aten op of a capture; snapshots each storage an op writes, first time, so
    the capture's effects can be undone."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self.ops: list[tuple[Any, tuple, dict, Any]] = []
        self._saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse(self.name, func, args)
        for schema, value in self._arguments(func, args, kwargs):
            if schema.alias_info is not None and schema.alias_info.is_write:
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor):
                        self._snapshot(t)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    @staticmethod
    def _arguments(func, args: tuple, kwargs: dict) -> Iterator[tuple[Any, Any]]:
        by_name = {a.name: a for a in func._schema.arguments}
        yield from zip(func._schema.arguments, args)
        for name, value in kwargs.items():
            if name in by_name:
                yield by_name[name], value

    def launch(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run and record one kernel launch (``fn``: an ``inkfw.kernels`` Triton function)."""
        with _disable_current_modes():  # the snapshots' copies and the interpreter's stay unrecorded
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    self._snapshot(t)
            with _Refusing(f"{self.name}: {getattr(fn, '__name__', fn)}"):  # host reads in its launch code
                out = fn(*args, **kwargs)
        self.ops.append((fn, args, kwargs, out))
        return out

    def _snapshot(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._saved:
            self._saved[storage.data_ptr()] = (storage, storage.clone())

    def undo(self) -> None:
        """Put back every storage the capture wrote."""
        for storage, saved in self._saved.values():
            storage.copy_(saved)
        self._saved.clear()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class RecordedCudaGraphs:
    """Patches ``torch.cuda`` and ``inkfw.kernels`` (see the module docstring) for the life of
    ``monkeypatch``; build engines after it. ``replays`` counts graph replays, ``captures``
    captures, ``launches`` the Triton launches recorded in them by function name."""

    def __init__(self, monkeypatch) -> None:
        self.replays = 0
        self.captures = 0
        self.recorder: _Recorder | None = None  # while a capture runs
        self.launches: collections.Counter[str] = collections.Counter()  # Triton launches recorded, by function
        sim = self

        class Stream:
            def wait_stream(self, other: Any) -> None:
                pass

        class Graph:
            def __init__(self) -> None:
                self.ops: list[tuple[Any, tuple, dict, Any]] = []

            def replay(self) -> None:
                with torch.no_grad():
                    for func, args, kwargs, out in self.ops:
                        result = func(*args, **kwargs)
                        for captured, now in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                            if isinstance(captured, torch.Tensor) and not _same_memory(captured, now):
                                captured.copy_(now)  # the graph's fixed address for this result
                sim.replays += 1

        @contextlib.contextmanager
        def graph(g: Graph) -> Iterator[None]:
            sim.recorder = recorder = _Recorder("captured step")
            try:
                with recorder:
                    yield
            finally:
                sim.recorder = None
                recorder.undo()
            g.ops = recorder.ops
            sim.captures += 1

        implementation = kernels_module.implementation

        def recorded_implementation(op: str, backend: str) -> Callable[..., Any]:
            fn = implementation(op, backend)
            if backend != "triton":
                return fn

            @functools.wraps(fn)
            def launch(*args: Any, **kwargs: Any) -> Any:
                if sim.recorder is None:
                    return fn(*args, **kwargs)
                sim.launches[fn.__name__] += 1
                return sim.recorder.launch(fn, args, kwargs)

            return launch

        monkeypatch.setattr(kernels_module, "implementation", recorded_implementation)

        monkeypatch.setattr(engine_module, "captures_cuda_graphs", lambda device: True)  # engine.cuda_graphs=true here
        for name, value in {
            "Stream": Stream,
            "current_stream": Stream,
            "stream": lambda s: contextlib.nullcontext(),
            "CUDAGraph": Graph,
            "graph": graph,
            "synchronize": lambda: None,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
