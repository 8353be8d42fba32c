"""The four seams of the speculative engine, as small protocols.

The engine only talks to these; Hydra groups (``conf/drafter``, ``conf/sampler``, ``conf/kv``)
pick the implementations. Positions follow the design (§3): a request with ``L`` committed
tokens has final target state for positions ``< L - 1``; a verify step runs the target over
``[x[L-1], d_1 .. d_k]`` at positions ``L-1 .. L-1+k``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from inkfw.cache.interface import LayerCache
from inkfw.speculative.sampling import Generators, SamplingParams


@runtime_checkable
class RequestLike(Protocol):
    """What a drafter may read about a request."""

    id: Hashable
    token_ids: list[int]  # committed: prompt + accepted output
    sampling: SamplingParams
    generator: torch.Generator | None


@dataclass
class DraftSpan:
    """One request's input to a drafting round.

    ``hidden`` [T, H] are the target's final hidden states of positions ``start ..
    start + T - 1`` that became final since the previous round (a prefill chunk, or the
    accepted positions of a verify step). ``num_accepted``: drafts the preceding verify
    accepted (None after a prefill chunk). ``num_drafts``: drafts wanted after this span
    (0 for a prefill chunk that is not the prompt's last).
    """

    request: RequestLike
    start: int
    hidden: torch.Tensor | None
    num_accepted: int | None
    num_drafts: int


@dataclass
class Drafts:
    """Drafts for a batch of spans: ``tokens`` [B, k] (entries past ``num_drafts[b]`` are
    padding), ``probs`` [B, k, V]: the distributions they were sampled from (None: each draft
    was chosen deterministically, i.e. q is one-hot), ``logits`` [B, k, V]: the raw draft
    logits, kept only when asked for (``check_drafts``)."""

    tokens: torch.Tensor
    num_drafts: torch.Tensor
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @staticmethod
    def empty(batch: int, device: torch.device | str = "cpu") -> Drafts:
        return Drafts(torch.zeros(batch, 0, dtype=torch.long, device=device),
                      torch.zeros(batch, dtype=torch.long, device=device))


class KVManager(Protocol):
    """Owns every byte of cache: target layers and every draft depth (KV and conv state)."""

    def add(self, rid: Hashable, tokens: Sequence[int]) -> int: ...  # -> prefix-cache hit length
    def ensure(self, rid: Hashable, target_end: int, draft_end: int) -> bool: ...
    def free(self, rid: Hashable) -> None: ...
    def finalize(self, rid: Hashable, tokens: Sequence[int], num_final: int) -> None: ...
    def trim(self, rid: Hashable, first_query: int) -> None: ...
    def target_caches(self, rids: Sequence[Hashable], positions: torch.Tensor,
                      valid: torch.Tensor) -> list[LayerCache]: ...
    def draft_cache(self, depth: int, rids: Sequence[Hashable], positions: torch.Tensor,
                    valid: torch.Tensor) -> LayerCache: ...
    def invalidate_draft(self, rid: Hashable, start: int, end: int) -> None: ...
    def is_whole(self) -> bool: ...


class Drafter(Protocol):
    """Proposes up to ``num_tokens`` drafts per request and verify step."""

    num_tokens: int  # k
    lookahead: int  # tokens after a position its cached state depends on (P for MTP, else 0)
    num_depths: int  # draft cache groups it needs (MTP depths; 0 without a cache)
    needs_hidden: bool  # whether spans must carry target hidden states

    def propose(self, spans: Sequence[DraftSpan], kv: KVManager) -> Drafts: ...
    def release(self, rid: Hashable) -> None: ...


@dataclass
class Verdict:
    """Outcome of a verify step: row b emits its first ``num_accepted[b]`` drafts, then
    ``next_tokens[b]``; ``hidden`` [B, k+1, H] are the target's hidden states."""

    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    hidden: torch.Tensor


class Verifier(Protocol):
    """Runs the target over ``[last token, drafts]`` and decides acceptance."""

    def verify(self, model, kv: KVManager, requests: Sequence[RequestLike], drafts: Drafts) -> Verdict: ...


class TokenSampler(Protocol):
    """Greedy / temperature / top-k / top-p with per-request seeded generators."""

    def generator(self, params: SamplingParams) -> torch.Generator: ...
    def probs(self, logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor: ...
    def sample(self, probs: torch.Tensor, generators: Generators = None) -> torch.Tensor: ...
    def __call__(self, logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams],
                 generators: Generators = None) -> torch.Tensor: ...
