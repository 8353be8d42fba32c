"""The engine benchmark behind ``scripts/bench.py``: :mod:`~inkfw.bench.run` (the run) and
:mod:`~inkfw.bench.timing` (what the engine's hooks report, summed per configuration)."""

from inkfw.bench.run import run_bench

__all__ = ["run_bench"]
