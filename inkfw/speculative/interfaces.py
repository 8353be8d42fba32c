"""The seams of the speculative engine, as small protocols.

The engine only talks to these; Hydra groups (``inkfw/conf/drafter``, ``inkfw/conf/verifier``,
``inkfw/conf/sampler``, ``inkfw/conf/kv``) pick the implementations and
:func:`~inkfw.speculative.factory.build_engine` builds them. Positions follow
docs/design.md §3: a request with ``L`` committed tokens has final target state for positions
``< L - 1``; a verify step runs the target over ``[x[L-1], d_1 .. d_k]`` at positions
``L-1 .. L-1+k``.

What the engine lends a component for one call is an argument of that call, never an
attribute it sets: the ``run`` of :meth:`Drafter.propose` and :meth:`Verifier.verify` is the
engine's timed runner for model calls (``run(fn, *args)`` returns ``fn(*args)``), and
``keep_logits`` asks the drafter for its raw logits (``engine.check_drafts``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from inkfw.cache.interface import LayerCache
from inkfw.models.inkling.config import InklingConfig
from inkfw.speculative.sampling import Generators, SamplingParams

T = TypeVar("T")


class _StrEnum(str, Enum):
    """A str-valued enum that prints and formats as its value (JSON writes the value too)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class RequestStatus(_StrEnum):
    WAITING = "waiting"  # queued, or preempted and to be recomputed
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(_StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_new_tokens or the model limit
    ERROR = "error"  # refused while running (e.g. larger than the KV pool)
    ABORT = "abort"  # cancelled by the caller (Engine.abort), e.g. a client that disconnected


class TargetModel(Protocol):
    """What the engine, the verifier and the drafters use of a model (an ``InklingLM``)."""

    cfg: InklingConfig  # max_position_embeddings, eos_token_ids, vocab_size, mtp sizes

    @property
    def num_mtp_depths(self) -> int: ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, caches: Sequence[LayerCache] | None = None
    ) -> torch.Tensor: ...  # [B, T] -> hidden [B, T, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [..., H] -> [..., V]

    def mtp_step(
        self,
        depth: int,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCache | None = None,
        depth_input: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor: ...  # g_d [B, T, H] -> g_{d+1} [B, T, H]; depth_input: a fused input kernel

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...


class ForwardRunner(Protocol):
    """``run(fn, *args)`` -> ``fn(*args)``; the engine's runner also times the call and tells its
    observers (:class:`~inkfw.speculative.observers.ForwardClock`)."""

    def __call__(self, fn: Callable[..., T], *args: Any) -> T: ...


@runtime_checkable
class RequestLike(Protocol):
    """What a drafter or verifier may read about a request (read-only)."""

    @property
    def id(self) -> Hashable: ...

    @property
    def token_ids(self) -> list[int]: ...  # committed: prompt + accepted output

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def generator(self) -> torch.Generator | None: ...


@dataclass
class DraftSpan:
    """One request's input to a drafting round.

    ``hidden`` [>= n, H]: its first ``n = num_new`` rows are the target's final hidden states
    of positions ``start .. start + n - 1`` that became final since the drafter's previous
    round (prefill chunks, or the accepted positions of verify steps); rows past them are
    ignored (a verify step passes its whole ``[k+1, H]`` row). ``num_accepted``: drafts the
    preceding verify accepted (None after a prefill chunk; 0 when in doubt: more re-prefill is
    always correct). ``num_drafts``: drafts wanted after this span (0 for a prefill chunk that
    is not the prompt's last). ``slot``: the request's fixed row in per-request device buffers.
    ``depths``: the MTP depths ``0 .. depths - 1`` the request drafts with, fixed for its life
    (adaptive k's admission, docs/design.md §5); None: every depth.
    """

    request: RequestLike
    start: int
    hidden: torch.Tensor | None
    num_accepted: int | None
    num_drafts: int
    slot: int = 0
    num_new: int | None = None  # None: len(hidden)
    depths: int | None = None

    @property
    def new_positions(self) -> int:
        return self.num_new if self.num_new is not None else len(self.hidden) if self.hidden is not None else 0


@dataclass
class Drafts:
    """Drafts for a batch of spans: ``tokens`` [B, k] (entries past ``num_drafts[b]`` are
    padding), ``probs`` [B, k, V]: the distributions they were sampled from (None: each draft
    was chosen deterministically, i.e. q is one-hot), ``logits`` [B, k, V]: the raw draft
    logits, only when asked for (``keep_logits``)."""

    tokens: torch.Tensor
    num_drafts: torch.Tensor
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    counts: list[int] | None = None  # num_drafts as host ints, when the drafter knows them (no read back)

    def host_counts(self) -> list[int]:
        """``num_drafts`` as host ints: :attr:`counts`, or read back when the drafter gave none."""
        return self.counts if self.counts is not None else self.num_drafts.tolist()

    @staticmethod
    def empty(batch: int, device: torch.device | str = "cpu") -> Drafts:
        return Drafts(
            torch.zeros(batch, 0, dtype=torch.long, device=device), torch.zeros(batch, dtype=torch.long, device=device)
        )


class KVManager(Protocol):
    """Owns every byte of cache: target layers and every draft depth (KV and conv state)."""

    def add(self, rid: Hashable, tokens: Sequence[int], draft_depths: int | None = None) -> int: ...  # -> hit length
    def ensure(self, rid: Hashable, target_end: int, draft_end: int) -> bool: ...
    def free(self, rid: Hashable) -> None: ...
    def drop_draft_depths(self, rid: Hashable, keep: int) -> None: ...  # rid drafts with depths < keep from now on
    def finalize(
        self, rid: Hashable, tokens: Sequence[int], num_final: int, num_final_draft: int | None = None
    ) -> None: ...
    def trim(self, rid: Hashable, first_query: int) -> None: ...
    # a forward's caches: block tables from host values, then views from tensors (docs/design.md §4)
    def group_indices(self, draft_depth: int | None = None) -> list[int]: ...
    def step_tables(
        self,
        groups: Sequence[int],
        rids: Sequence[Hashable | None],
        first: Sequence[int],
        end: Sequence[int],
        width: Callable[[int], int] = ...,
        stage: Callable[[str, list], torch.Tensor] | None = None,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]: ...
    def caches_from(
        self,
        tables: dict[int, tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        valid: torch.Tensor,
        draft_depth: int | None = None,
    ) -> Sequence[LayerCache]: ...
    def forget_from(
        self, tables: dict[int, tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor, valid: torch.Tensor
    ) -> None: ...
    def is_whole(self) -> bool: ...
    def usage(self) -> float: ...  # fraction (0..1) of the target's full-attention blocks requests hold
    @property
    def nbytes(self) -> int: ...  # every byte of cache it allocated


class TokenSampler(Protocol):
    """Greedy / temperature / top-k / top-p with per-request seeded generators: every processed
    distribution and every random number of the verifier and the drafters comes from here."""

    defaults: SamplingParams  # for requests that bring no SamplingParams of their own (inkfw/conf/sampler)

    def generator(self, params: SamplingParams) -> torch.Generator: ...

    def probs(self, logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams]) -> torch.Tensor: ...

    def sample(self, probs: torch.Tensor, generators: Generators = None) -> torch.Tensor: ...

    def acceptance_draws(
        self,
        generators: Generators,
        num_drafts: torch.Tensor | Sequence[int],
        width: int,
        vocab: int,
        device: torch.device | str,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def __call__(
        self, logits: torch.Tensor, params: SamplingParams | Sequence[SamplingParams], generators: Generators = None
    ) -> torch.Tensor: ...


class Drafter(Protocol):
    """Proposes up to ``num_tokens`` drafts per request and verify step.

    Built by the factory from ``inkfw/conf/drafter`` with the run-time arguments it names of
    ``model``, ``num_tokens``, ``num_depths`` and ``sampler``.
    """

    num_tokens: int  # k
    lookahead: int  # tokens after a position its cached state depends on (P for MTP, else 0)
    num_depths: int  # draft cache groups it needs (MTP depths; 0 without a cache)
    needs_hidden: bool  # whether spans must carry target hidden states

    def propose(
        self,
        spans: Sequence[DraftSpan],
        kv: KVManager,
        run: ForwardRunner,
        keep_logits: bool = False,
        pad_to: int | None = None,
        num_tokens: int | None = None,
    ) -> Drafts: ...  # pad_to: rows of a static batch bucket; num_tokens: this round's k (<= num_tokens)

    def release(self, rid: Hashable) -> None: ...

    def stale_from(self, rid: Hashable) -> int | None: ...  # first position a draft cache may still lack; None: none


@dataclass
class Verdict:
    """Outcome of a verify step: row b emits its first ``num_accepted[b]`` drafts, then
    ``next_tokens[b]``; ``hidden`` [B, k+1, H] are the target's hidden states."""

    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    hidden: torch.Tensor


class Verifier(Protocol):
    """Runs the target over ``[last token, drafts]`` and decides acceptance.

    Built by the factory from ``inkfw/conf/verifier`` with the run-time arguments it names of
    ``model`` and ``sampler``.
    """

    def verify(
        self,
        kv: KVManager,
        requests: Sequence[RequestLike],
        drafts: Drafts,
        run: ForwardRunner,
        pad_to: int | None = None,
    ) -> Verdict: ...  # pad_to: rows of a static batch bucket (padding rows write only scratch slots)

    def prefill(
        self,
        kv: KVManager,
        chunks: Sequence[tuple[Hashable, Sequence[int], int]],
        run: ForwardRunner,
        pad_to: int | None = None,
    ) -> list[torch.Tensor]: ...  # (request id, tokens, first position) -> hidden [len(tokens), H] each
