"""Acceptance metrics of speculative decoding, counted the way peers report them.

One *step* is one request's verify step: it drafted ``num_drafts`` tokens, accepted the first
``num_accepted`` of them and emitted ``num_accepted + 1`` tokens (the +1 is the bonus or
replacement token). From these counts:

* mean acceptance length tau = (accepted drafts + bonus tokens) / steps = 1 + accepted / steps;
* per-position acceptance (unconditional, vLLM style): steps that accepted position i / steps,
  so tau = 1 + sum_i rate_i;
* conditional acceptance: steps that accepted draft i / steps that reached it (drafted it and
  accepted every draft before it). With one k for every step this is accepted at i / accepted
  at i-1; with k changing step to step (adaptive k) a step that accepted all of its k drafts
  never reached draft k + 1, so it does not count against that position.

Rates with nothing to divide by are reported as 0.0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def _as_list(x: torch.Tensor | Sequence[int] | int) -> list[int]:
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.reshape(-1).tolist()]
    if isinstance(x, int):
        return [x]
    return [int(v) for v in x]


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def drafts_reached(num_drafts: int, num_accepted: int) -> int:
    """Drafts a verify step reached: drafted, with every draft before accepted (the accepted
    ones and the first rejected one). Conditional acceptance counts a draft only where reached."""
    return min(num_accepted + 1, num_drafts)


def _add_at(counts: list[int], n: int) -> None:
    """Add 1 to ``counts[0 .. n-1]``, growing the list as needed."""
    if n > len(counts):
        counts.extend([0] * (n - len(counts)))
    for i in range(n):
        counts[i] += 1


@dataclass
class SpecMetrics:
    """Accumulates verify steps; all fields are plain counts."""

    num_steps: int = 0  # verify steps, one per request per engine step
    num_drafts: int = 0  # steps that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: steps that accepted draft i
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: steps that drafted a token at i
    reached_per_position: list[int] = field(default_factory=list)  # [i]: drafted i, accepted all before

    def record(
        self, num_drafts: torch.Tensor | Sequence[int] | int, num_accepted: torch.Tensor | Sequence[int] | int
    ) -> None:
        """Record one verify step of each request: ``num_drafts`` and ``num_accepted``, ints
        or [B] tensors/sequences with ``0 <= num_accepted <= num_drafts`` elementwise."""
        drafts, accepted = _as_list(num_drafts), _as_list(num_accepted)
        if len(drafts) != len(accepted):
            raise ValueError(f"{len(drafts)} num_drafts but {len(accepted)} num_accepted")
        for d, a in zip(drafts, accepted):
            if not 0 <= a <= d:
                raise ValueError(f"need 0 <= num_accepted <= num_drafts, got num_accepted={a}, num_drafts={d}")
        for d, a in zip(drafts, accepted):
            self.num_steps += 1
            self.num_drafts += d > 0
            self.num_draft_tokens += d
            self.num_accepted_tokens += a
            _add_at(self.drafted_per_position, d)
            _add_at(self.accepted_per_position, a)
            _add_at(self.reached_per_position, drafts_reached(d, a))
        # keep the lists the same length: positions drafted but never accepted show 0
        for counts in (self.accepted_per_position, self.reached_per_position):
            counts.extend([0] * (len(self.drafted_per_position) - len(counts)))

    def merge(self, other: SpecMetrics) -> None:
        """Add ``other``'s counts to these (e.g. from another worker)."""
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for mine, theirs in (
            (self.accepted_per_position, other.accepted_per_position),
            (self.drafted_per_position, other.drafted_per_position),
            (self.reached_per_position, other.reached_per_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, c in enumerate(theirs):
                mine[i] += c

    # ----------------------------------------------------------------- derived
    @property
    def num_emitted_tokens(self) -> int:
        """Accepted drafts plus one bonus/replacement token per step."""
        return self.num_accepted_tokens + self.num_steps

    @property
    def mean_acceptance_length(self) -> float:
        """tau: tokens emitted per verify step."""
        return _ratio(self.num_emitted_tokens, self.num_steps)

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted drafts / drafted tokens."""
        return _ratio(self.num_accepted_tokens, self.num_draft_tokens)

    @property
    def per_position_acceptance(self) -> list[float]:
        """[i]: steps that accepted draft i / steps (unconditional); tau = 1 + sum."""
        return [_ratio(c, self.num_steps) for c in self.accepted_per_position]

    @property
    def conditional_acceptance(self) -> list[float]:
        """[i]: steps that accepted draft i / steps that reached it (drafted it, accepted all before)."""
        return [_ratio(c, r) for c, r in zip(self.accepted_per_position, self.reached_per_position)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "per_position_acceptance": self.per_position_acceptance,
            "conditional_acceptance": self.conditional_acceptance,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "reached_per_position": list(self.reached_per_position),
        }


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens per verify step of a chain of ``k`` drafts, each accepted with
    probability ``alpha`` given its predecessors: (1 - alpha^(k+1)) / (1 - alpha)."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def simulated_acceptance_length(acc: Iterable[float]) -> float:
    """Acceptance length implied by per-depth accuracies acc_j (depth j right given depths
    before it are): 1 + sum_k prod_{j<=k} acc_j."""
    total, chain = 1.0, 1.0
    for a in acc:
        chain *= a
        total += chain
    return total
