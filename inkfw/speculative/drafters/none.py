"""The autoregressive baseline: no drafts, every verify step is one plain decode step."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from inkfw.speculative.interfaces import Drafts, DraftSpan, ForwardRunner, KVManager
from inkfw.speculative.observers import run_directly


class NoDrafter:
    num_tokens = 0
    lookahead = 0
    num_depths = 0
    needs_hidden = False

    def __init__(self, **_: object):
        pass

    def propose(
        self,
        spans: Sequence[DraftSpan],
        kv: KVManager,
        run: ForwardRunner = run_directly,
        keep_logits: bool = False,
        pad_to: int | None = None,
        num_tokens: int | None = None,
    ) -> Drafts:
        drafts = Drafts.empty(len(spans))
        drafts.counts = [0] * len(spans)
        return drafts

    def release(self, rid: Hashable) -> None:
        pass

    def stale_from(self, rid: Hashable) -> None:
        return None  # no cache
