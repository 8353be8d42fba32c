"""The benchmark behind ``scripts/bench.py``: :mod:`~inkfw.bench.run` (the run),
:mod:`~inkfw.bench.plan` (which runs, in which order), :mod:`~inkfw.bench.prompt_sets`,
:mod:`~inkfw.bench.hf_baseline` (HF transformers ``generate``), :mod:`~inkfw.bench.exactness`
(greedy outputs token for token) and :mod:`~inkfw.bench.timing` (what the engine's hooks
report, summed per run)."""

from inkfw.bench.run import run_bench

__all__ = ["run_bench"]
