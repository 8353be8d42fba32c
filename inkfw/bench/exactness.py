"""Greedy exactness of the benchmark's runs: token-for-token equality of outputs.

Greedy speculative decoding is lossless (docs/design.md §3): at temperature 0 every inkfw run
of one prompt set and batch size (any mode: eager, compiled, CUDA graphs; any drafter and k)
must emit exactly the tokens of that group's *reference*, its first inkfw run (plain decoding
in the first mode when planned). A difference fails the benchmark (exit code 1) after its
files are written. HF's outputs are compared with inkfw's at batch 1 for information only
(different kernels may break a near-tie differently).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

Outputs = Sequence[Sequence[int]]  # generated token ids per request


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (a length difference counts), or
    None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def differing_requests(outputs: Outputs, reference: Outputs) -> list[int]:
    """Indices of the requests whose tokens differ from ``reference``'s."""
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs against {len(reference)} reference outputs")
    return [i for i, (a, b) in enumerate(zip(outputs, reference)) if first_difference(a, b) is not None]


@dataclass
class Mismatch:
    """A run whose outputs differ from its group's reference."""

    prompt_set: str
    batch_size: int
    run: str
    reference: str
    repeat: int
    requests: list[int]  # indices of the requests that differ
    first_position: int  # first differing token of the first such request

    def line(self) -> str:
        return (
            f"{self.prompt_set}, batch {self.batch_size}, repeat {self.repeat + 1}: {self.run} differs from "
            f"{self.reference} in {len(self.requests)} request(s) {self.requests[:8]}"
            f"{' ...' if len(self.requests) > 8 else ''}; first at request {self.requests[0]}, "
            f"token {self.first_position}"
        )


@dataclass
class ExactnessCheck:
    """Collects each group's outputs run by run and compares them with the group's reference."""

    mismatches: list[Mismatch] = field(default_factory=list)
    references: dict[tuple[str, int], str] = field(default_factory=dict)  # (set, batch) -> run
    compared: int = 0  # runs compared with a reference
    _outputs: dict[tuple[str, int, int], tuple[str, Outputs]] = field(default_factory=dict)

    def add(self, prompt_set: str, batch_size: int, repeat: int, run: str, outputs: Outputs) -> list[int]:
        """Compare ``run``'s outputs with its group's reference (the group's first run becomes
        the reference); returns the indices of the requests that differ."""
        key = (prompt_set, batch_size, repeat)
        if key not in self._outputs:
            self._outputs[key] = (run, outputs)
            self.references.setdefault((prompt_set, batch_size), run)  # the first repeat's
            return []
        reference, expected = self._outputs[key]
        differ = differing_requests(outputs, expected)
        self.compared += 1
        if differ:
            first = first_difference(outputs[differ[0]], expected[differ[0]])
            assert first is not None
            self.mismatches.append(Mismatch(prompt_set, batch_size, run, reference, repeat, differ, first))
        return differ

    def reference_outputs(self, prompt_set: str, batch_size: int, repeat: int) -> Outputs | None:
        found = self._outputs.get((prompt_set, batch_size, repeat))
        return None if found is None else found[1]

    @property
    def ok(self) -> bool:
        return not self.mismatches

    def summary(self) -> dict[str, Any]:
        """The ``exactness`` entry of ``bench.json``."""
        return {
            "checked": True,
            "ok": self.ok,
            "runs_compared": self.compared,
            "references": {f"{s} b{b}": run for (s, b), run in self.references.items()},
            "mismatches": [m.__dict__ | {"line": m.line()} for m in self.mismatches],
        }


def unchecked_summary(reason: str) -> dict[str, Any]:
    """The ``exactness`` entry when outputs are not compared (sampling)."""
    return {"checked": False, "ok": True, "reason": reason, "runs_compared": 0, "references": {}, "mismatches": []}
