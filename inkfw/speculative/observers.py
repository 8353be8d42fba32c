"""Engine hooks: what a benchmark, a server or a profiler may watch, without touching components.

Subclass :class:`EngineObserver`, override what you need, and register it with
``engine.add_observer(obs)`` (``engine.remove_observer(obs)`` to stop). The engine calls

* ``on_forward_start(phase)`` / ``on_forward_end(phase, seconds)`` around every model call it
  runs, ``phase`` being ``"target"`` (prefill chunks, verify steps and their logits) or
  ``"draft"`` (MTP depths and their logits); ``seconds`` is the call's wall time (CUDA is
  synchronised on both sides, so it is the device time too). The observer's own work is
  outside that time;
* ``on_step_end(engine, finished)`` after every engine step, with the requests that finished
  in it.

:class:`ForwardClock` is the runner the engine hands to its verifier and drafter (one per
phase): it times each call, adds it to ``seconds`` (the engine's ``StepTimes.forward_s``) and
tells the observers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

if TYPE_CHECKING:
    from inkfw.speculative.engine import Engine, Request

Phase = Literal["target", "draft"]
T = TypeVar("T")


class EngineObserver:
    """No-op hooks; override the ones you need."""

    def on_forward_start(self, phase: Phase) -> None:
        pass

    def on_forward_end(self, phase: Phase, seconds: float) -> None:
        pass

    def on_step_end(self, engine: Engine, finished: Sequence[Request]) -> None:
        pass


class ForwardClock:
    """Times the model calls the engine runs and reports each one to the observers."""

    def __init__(self, device: torch.device | str, observers: list[EngineObserver] | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.observers = observers if observers is not None else []
        self.seconds = 0.0  # all forwards so far

    def run(self, phase: Phase, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, timed as one ``phase`` forward."""
        for obs in self.observers:
            obs.on_forward_start(phase)
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args)
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        self.seconds += seconds
        for obs in self.observers:
            obs.on_forward_end(phase, seconds)
        return out

    def runner(self, phase: Phase) -> Callable[..., Any]:
        """``run(fn, *args)`` for one phase: what a verifier or drafter is given."""

        def run(fn: Callable[..., T], *args: Any) -> T:
            return self.run(phase, fn, *args)

        return run


def run_directly(fn: Callable[..., T], *args: Any) -> T:
    """The untimed runner: ``fn(*args)`` (components called outside an engine)."""
    return fn(*args)
