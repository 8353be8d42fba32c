"""Which runs ``scripts/bench.py`` makes, in which order: the round-robin plan.

A run is one system decoding one prompt set at one batch size:

* ``hf``: Hugging Face transformers ``generate`` (``generate``) or ``generate(use_mtp=True)``
  (``generate_mtp``) on the same checkpoint, always at batch 1;
* ``inkfw``: the engine in one *mode* (how its step runs: :data:`MODES`) with one drafter
  (``none``: plain decoding; ``mtp`` / ``ngram``: one run per entry of the k list, an integer
  or ``auto``) at one batch size.

:func:`plan_runs` expands the option lists into the ordered list of runs of one round; the
benchmark repeats that round ``repeats`` times per prompt set, so a noisy machine slows every
run alike, in the plan's order and reversed in turn (:func:`round_order`). Runs that share mode, drafter, k and batch size share one engine.

How finely runs take turns is ``interleave`` (:func:`interleaved_batches`): ``set``, each run
decodes a whole prompt set before the next starts; ``batch``, the set is cut into batches of
lcm(batch sizes) prompts and every run decodes each batch in turn (reversed on every other batch),
so neighbouring runs are seconds apart, not minutes, and load that drifts weighs on every run
alike (the ratios per repeat, :func:`inkfw.bench.run.add_repeat_ratios`, show what is left).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from inkfw.errors import ConfigError
from inkfw.options import is_int
from inkfw.presets import plain

AUTO = "auto"  # spec.num_tokens=auto: the engine picks k each step (inkfw.speculative.adaptive)
# engine options per mode (inkfw/conf/engine: EngineConfig.compile / cuda_graphs)
MODES: dict[str, dict[str, bool]] = {
    "eager": {"compile": False, "cuda_graphs": False},
    "compiled": {"compile": True, "cuda_graphs": False},  # torch.compile of verify and draft steps
    "graphs": {"compile": False, "cuda_graphs": True},  # CUDA graphs per batch bucket (CUDA only)
    "compiled_graphs": {"compile": True, "cuda_graphs": True},
}
HF_SYSTEMS = {"generate": False, "generate_mtp": True}  # name -> use_mtp
HF_BATCH_SIZE = 1
HF_MODE = "hf"

INTERLEAVE = ("set", "batch")  # how finely runs take turns (interleaved_batches)

NumTokens = int | str  # k >= 1, 0 for plain decoding, or "auto"


@dataclass(frozen=True)
class BenchRun:
    """One configuration of a round: what runs, with which drafter and k, at which batch size."""

    system: str  # "hf" | "inkfw"
    mode: str  # a MODES key; HF_MODE for hf
    drafter: str  # inkfw/conf/drafter option (none, mtp, ngram); hf: none | mtp
    num_tokens: NumTokens  # 0 without drafts
    batch_size: int

    @property
    def name(self) -> str:
        if self.system == "hf":
            return "hf generate" + ("(use_mtp)" if self.drafter == "mtp" else "")
        k = "" if self.drafter == "none" else f" k={self.num_tokens}"
        return f"{self.mode} {self.drafter}{k} b{self.batch_size}"

    @property
    def engine_key(self) -> tuple[str, str, NumTokens, int]:
        """Runs with the same key decode on the same engine."""
        return (self.mode, self.drafter, self.num_tokens, self.batch_size)

    @property
    def use_mtp(self) -> bool:
        return self.system == "hf" and self.drafter == "mtp"


# ------------------------------------------------------------------------ options
def _listed(value: Any) -> list[Any]:
    value = plain(value)
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def positive_ints(value: Any, what: str) -> list[int]:
    """A non-empty list of integers >= 1 (duplicates dropped, order kept)."""
    items = _listed(value)
    if not items or not all(is_int(v) and v >= 1 for v in items):
        raise ConfigError(f"{what} must be a non-empty list of integers >= 1, got {plain(value)!r}.")
    return list(dict.fromkeys(items))


def choices(value: Any, what: str, options: list[str] | tuple[str, ...], allow_empty: bool = False) -> list[str]:
    """A list drawn from ``options`` (duplicates dropped, order kept)."""
    items = _listed(value)
    if (not items and not allow_empty) or any(v not in options for v in items):
        raise ConfigError(f"{what} must be a list drawn from {', '.join(options)}, got {plain(value)!r}.")
    return list(dict.fromkeys(items))


def num_tokens_list(value: Any) -> list[NumTokens]:
    """The k list of the drafting runs: integers >= 1 and/or ``auto``."""
    items = _listed(value)
    if not items or not all((is_int(v) and v >= 1) or v == AUTO for v in items):
        raise ConfigError(f"num_tokens must be a non-empty list of integers >= 1 and/or auto, got {plain(value)!r}.")
    return list(dict.fromkeys(items))


# ------------------------------------------------------------------------ the plan
def plan_runs(
    drafters: list[str],
    num_tokens: list[NumTokens],
    modes: list[str],
    batch_sizes: list[int],
    hf: list[str],
    auto_modes: list[str] | None = None,
) -> list[BenchRun]:
    """The runs of one round, in order: the HF baselines (batch 1), then per batch size, mode
    and drafter the inkfw runs (``none`` once, any other drafter once per k; k = auto only in
    ``auto_modes``, None: in every mode)."""
    runs = [BenchRun("hf", HF_MODE, "mtp" if HF_SYSTEMS[s] else "none", 0, HF_BATCH_SIZE) for s in hf]
    for batch in batch_sizes:
        for mode in modes:
            for drafter in drafters:
                for k in [0] if drafter == "none" else num_tokens:
                    if k != AUTO or auto_modes is None or mode in auto_modes:
                        runs.append(BenchRun("inkfw", mode, drafter, k, batch))
    return runs


def round_order(runs: list[BenchRun], repeat: int) -> list[BenchRun]:
    """The order of repeat ``repeat`` (from 0): the plan's on even repeats, reversed on odd ones,
    so over an even number of repeats no run always comes first or right after the same one
    (load, caches or clocks that drift within a round weigh on every run alike)."""
    return list(runs) if repeat % 2 == 0 else list(reversed(runs))


def interleaved_batches(prompts: list[list[int]], runs: list[BenchRun], interleave: str) -> list[list[list[int]]]:
    """``prompts`` as a round decodes them, one part after another, every run decoding each part
    in turn: the whole set (``set``), or slices of lcm(the runs' batch sizes) prompts (``batch``;
    at batch 1 alone, one prompt), so every run's batches are whole in every slice."""
    if interleave == "set":
        return [prompts]
    size = math.lcm(*(r.batch_size for r in runs))
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]
