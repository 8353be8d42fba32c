"""Prompt-lookup drafting: continue the latest earlier occurrence of the sequence's suffix.

No model and no cache: it exists to show that the engine carries any drafter. Drafts are
deterministic, so rejection sampling treats them as one-hot proposals (still lossless).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from inkfw.errors import ConfigError
from inkfw.speculative.interfaces import Drafts, DraftSpan, ForwardRunner, KVManager
from inkfw.speculative.observers import run_directly


def lookup(tokens: Sequence[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_tokens`` tokens that followed the most recent earlier occurrence of the
    longest suffix of ``tokens`` of length in [min_n, max_n]; [] if none occurs."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = list(tokens[L - n :])
        for start in range(L - n - 1, -1, -1):  # most recent match first
            if list(tokens[start : start + n]) == suffix:
                return list(tokens[start + n : start + n + num_tokens])
    return []


class NgramDrafter:
    lookahead = 0
    num_depths = 0
    needs_hidden = False

    def __init__(self, num_tokens: int, min_n: int = 1, max_n: int = 3, **_: object):
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"drafter: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}.")
        self.num_tokens, self.min_n, self.max_n = num_tokens, min_n, max_n

    def propose(
        self,
        spans: Sequence[DraftSpan],
        kv: KVManager,
        run: ForwardRunner = run_directly,
        keep_logits: bool = False,
        pad_to: int | None = None,
        num_tokens: int | None = None,
    ) -> Drafts:
        """Host-side lookup: ``pad_to`` changes nothing (no forward runs); ``num_tokens`` caps k."""
        k = self.num_tokens if num_tokens is None else num_tokens
        tokens = torch.zeros(len(spans), k, dtype=torch.long)
        counts = []
        for b, span in enumerate(spans):
            found = lookup(span.request.token_ids, min(k, span.num_drafts), self.min_n, self.max_n)
            tokens[b, : len(found)] = torch.tensor(found, dtype=torch.long)
            counts.append(len(found))
        return Drafts(tokens, torch.tensor(counts, dtype=torch.long), counts=counts)

    def release(self, rid: Hashable) -> None:
        pass

    def stale_from(self, rid: Hashable) -> None:
        return None  # no cache
