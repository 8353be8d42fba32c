"""The speculative engine: schedule -> prefill / verify -> accept -> draft -> bookkeeping.

Continuous batching over requests of any length and acceptance. A request with ``L``
committed tokens (prompt + output) is either

* prefilling: the target computes positions ``[num_computed, L - 1)`` in chunks (the last
  committed token is fed by the next verify step, so prefill never samples), or
* decoding: one verify step runs ``[x[L-1], d_1 .. d_n]`` and emits ``a + 1`` tokens.

After either, the drafter gets the positions whose target state just became final and
proposes the next drafts. A fresh prompt and a preempted request (recomputed from its
committed tokens) take the same path, so preemption never changes greedy output
(docs/design.md §5).

Build engines with :func:`~inkfw.speculative.factory.build_engine`; watch them with
:class:`~inkfw.speculative.observers.EngineObserver` hooks (:meth:`Engine.add_observer`).
"""

from __future__ import annotations

import collections
import itertools
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

from inkfw.errors import ConfigError
from inkfw.options import bool_option, int_option, is_int, optional_bool_option
from inkfw.speculative.adaptive import AdaptiveK, fit_step_costs
from inkfw.speculative.interfaces import (
    Drafter,
    Drafts,
    DraftSpan,
    FinishReason,
    KVManager,
    RequestLike,
    RequestStatus,
    TargetModel,
    TokenSampler,
    Verifier,
)
from inkfw.speculative.metrics import SpecMetrics
from inkfw.speculative.observers import EngineObserver, ForwardClock
from inkfw.speculative.reference import reference_draft_logits
from inkfw.speculative.sampling import Sampler, SamplingParams
from inkfw.speculative.step import DEFAULT_BUCKETS, bucket_for, captures_cuda_graphs

LAG_LIMIT = 32  # positions a request's drafter may fall behind while adaptive k chooses 0 (then it stops)


class DraftCheckError(RuntimeError):
    """``engine.check_drafts``: a draft differs from the uncached reference."""


@dataclass
class EngineConfig:
    """Scheduling limits and checks of the engine: the ``inkfw/conf/engine`` node, every field settable
    as ``engine.<field>=...``."""

    max_num_seqs: int = 16  # requests decoded together
    max_num_batched_tokens: int = 512  # target tokens per step (prefill chunks + verify tokens)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    check_drafts: bool = False  # recompute every draft with the uncached reference
    check_drafts_atol: float = 1e-3  # logits tolerance of that check
    compile: bool = False  # torch.compile the verify step and the drafting round
    cuda_graphs: bool | None = None  # capture them as CUDA graphs per shape (None: on when on CUDA)
    batch_buckets: tuple[int, ...] = DEFAULT_BUCKETS  # decode batches run padded to these sizes
    pad_batches: bool | None = None  # pad decode batches to a bucket (None: when compiled or graph-captured)

    def validate(self) -> None:
        """Raise :class:`ConfigError` (one sentence) naming the first field out of range."""
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            int_option(v, f"engine.{name}")
        m = self.max_model_len
        if m is not None and (not is_int(m) or m < 2):
            raise ConfigError(
                f"engine.max_model_len must be null or an integer >= 2 (null: the model's "
                f"max_position_embeddings), got {m!r}."
            )
        for name in ("check_drafts", "compile"):
            bool_option(getattr(self, name), f"engine.{name}")
        for name in ("cuda_graphs", "pad_batches"):
            optional_bool_option(getattr(self, name), f"engine.{name}")
        buckets = tuple(self.batch_buckets) if not isinstance(self.batch_buckets, (str, int)) else ()
        if not buckets or not all(is_int(b) and b >= 1 for b in buckets):
            raise ConfigError(f"engine.batch_buckets must be a list of integers >= 1, got {self.batch_buckets!r}.")
        self.batch_buckets = tuple(sorted(set(buckets)))
        atol = self.check_drafts_atol
        if not (isinstance(atol, (int, float)) and not isinstance(atol, bool) and math.isfinite(atol) and atol >= 0):
            raise ConfigError(f"engine.check_drafts_atol must be a finite number >= 0, got {atol!r}.")


@dataclass(eq=False)  # identity: the scheduler tests membership of running lists (O(1) per compare)
class Request:
    """One generation request and everything the engine tracks about it."""

    id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)  # committed: prompt + output
    generator: torch.Generator | None = None
    num_computed: int = 0  # leading positions with final target state
    slot: int | None = None  # fixed row in the engine's per-request device buffers while running
    num_pending: int = 0  # drafts waiting in the slot's buffer for the next verify step
    pending_width: int = 0  # k of the round that drafted them (the verify width)
    lag: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # (hidden rows, count) not drafted over
    lag_start: int | None = None  # first position of the lag (adaptive k chose 0 for those steps)
    drafting_off: bool = False  # adaptive k stopped its drafting (docs/design.md §6): plain from lag_start on
    draft_depths: int | None = None  # MTP depths it drafts with, set at admission (None: all; 0: none)
    depths_bucket: int = 0  # the batch bucket those depths were chosen for (a larger one may lower them)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def _compile_s(part: object) -> float:
    """Compile / capture seconds of a verifier's or drafter's step functions (0: it has none)."""
    return float(getattr(part, "warmup_s", 0.0))


@dataclass
class StepTimes:
    """Seconds of engine steps by phase (compiles and captures left out, docs/design.md §6), and
    how many of the steps, and which of their seconds, ran prompt chunks."""

    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards: prefill chunks and verify steps, with acceptance
    bookkeeping_s: float = 0.0
    forward_s: float = 0.0  # time inside model forwards (target and drafter)
    num_steps: int = 0
    prompt_steps: int = 0  # steps that ran prompt chunks (and their drafting rounds); decode rows may share them
    prompt_s: float = 0.0  # those steps' seconds (all three phases), part of total_s

    @property
    def total_s(self) -> float:
        return self.draft_s + self.verify_s + self.bookkeeping_s

    @property
    def decode_steps(self) -> int:
        """Steps that ran no prompt chunk: verify steps and drafting rounds only."""
        return self.num_steps - self.prompt_steps

    @property
    def decode_s(self) -> float:
        return self.total_s - self.prompt_s


class Engine:
    """Continuous batching over the four seams (see the module docstring). ``sampler`` is the one
    the verifier and drafter were built with; the engine uses it for per-request generators."""

    def __init__(
        self,
        model: TargetModel,
        drafter: Drafter,
        verifier: Verifier,
        kv: KVManager,
        sampler: TokenSampler | None = None,
        config: EngineConfig | None = None,
        tokenizer=None,
        adaptive: AdaptiveK | None = None,
    ):
        self.model, self.drafter, self.verifier, self.kv = model, drafter, verifier, kv
        self.adaptive = adaptive  # spec.num_tokens=auto: k chosen per step and batch bucket
        self.sampler = sampler or Sampler()
        self.config = config or EngineConfig()
        self.config.validate()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.max_model_len = min(
            self.config.max_model_len or model.cfg.max_position_embeddings, model.cfg.max_position_embeddings
        )
        self.eos_ids = set(model.cfg.eos_token_ids)
        self.vocab_size = model.cfg.vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.metrics = SpecMetrics()
        self.times = StepTimes()
        self.observers: list[EngineObserver] = []
        self.clock = ForwardClock(self.device, self.observers)  # every model call goes through it
        self._run_target = self.clock.runner("target")
        self._run_draft = self.clock.runner("draft")
        self._ids = itertools.count()
        self._failed: list[Request] = []
        self._preempted_this_step = False
        # per-request device state lives in fixed slots (+ one scratch row for padding)
        slots = self.config.max_num_seqs
        self._free_slots = list(range(slots))
        self._draft_tokens = torch.zeros(slots + 1, max(1, drafter.num_tokens), dtype=torch.long, device=self.device)
        self._no_drafts: dict[int, Drafts] = {}  # per batch size: the drafts of a step that verifies none
        self._draft_probs: torch.Tensor | None = None  # [slots + 1, k, V], once a request samples
        if hasattr(drafter, "reserve"):
            drafter.reserve(slots)  # type: ignore[attr-defined]
        on_cuda = self.device.type == "cuda"
        graphs = self.config.cuda_graphs if self.config.cuda_graphs is not None else on_cuda
        if graphs and not captures_cuda_graphs(self.device):
            raise ConfigError("engine.cuda_graphs=true needs the model on a CUDA device.")
        if self.config.pad_batches is False and (self.config.compile or graphs):
            raise ConfigError(
                "engine.pad_batches=false needs eager steps: compiled and graph-captured steps run at "
                "static shapes (set engine.compile=false and engine.cuda_graphs=false, or leave pad_batches null)."
            )
        for part in (verifier, drafter):
            if hasattr(part, "set_step_mode"):
                part.set_step_mode(compile=self.config.compile, cuda_graphs=graphs)  # type: ignore[attr-defined]
        self._warmup_wall_s = 0.0  # Engine.warmup's own seconds
        self._step_compile_in_warmup_s = 0.0  # the step functions' compile / capture seconds within them
        self._forced_k: int | None = None  # warm-up: every round drafts this many
        self.k_chosen: collections.Counter[int] = collections.Counter()  # k of each drafting round
        self.depths_admitted: collections.Counter[int] = collections.Counter()  # depths -> requests admitted
        self.depths_lowered = 0  # running requests whose depths a larger batch lowered
        self._typical_step_s: dict[int, float] = {}  # bucket -> decayed mean of decode steps without a probe
        self._probe_pair: tuple[int, float] | None = None  # (bucket, seconds) of a probe's drafting step

    # ------------------------------------------------------------------ observers
    def add_observer(self, observer: EngineObserver) -> None:
        """Call ``observer``'s hooks from now on (see :mod:`inkfw.speculative.observers`)."""
        if observer not in self.observers:
            self.observers.append(observer)

    def remove_observer(self, observer: EngineObserver) -> None:
        self.observers.remove(observer)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 64,
        stop: Iterable[str] = (),
    ) -> Request:
        """Queue a request; bad input raises :class:`ConfigError` and queues nothing."""
        ids = [int(t) for t in prompt_token_ids]
        sampling = sampling or SamplingParams()
        if not ids:
            raise ConfigError("the prompt is empty (0 tokens).")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ConfigError(f"prompt token ids must lie in [0, {self.vocab_size}), got {min(ids)}..{max(ids)}.")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                f"the prompt has {len(ids)} tokens; the model limit is {self.max_model_len} "
                f"(prompt + at least one new token)."
            )
        req = Request(
            next(self._ids),
            ids,
            sampling,
            max_new_tokens,
            tuple(stop),
            token_ids=list(ids),
            generator=self.sampler.generator(sampling) if not sampling.greedy else None,
            arrival_time=time.perf_counter(),
        )
        self.waiting.append(req)
        return req

    def abort(self, request: Request) -> None:
        """Cancel ``request``: it finishes with reason ``abort`` and its KV blocks and drafter
        state are freed now, so the next step neither schedules it nor holds its blocks. Call
        it between steps, from the thread that steps; a finished request is left as it is."""
        if request.finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self._release(request)
        self._finish(request, FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def generate(self, requests: Sequence[Request], on_tokens: Callable[[int], None] | None = None) -> list[Request]:
        """Run until every request in ``requests`` has finished."""
        produced = 0
        while any(not r.finished for r in requests):
            self.step()
            if on_tokens is not None:
                now = sum(len(r.output_token_ids) for r in requests)
                on_tokens(now - produced)
                produced = now
        return list(requests)

    # -------------------------------------------------------------------- warm-up
    @property
    def step_compile_s(self) -> float:
        """Seconds the verify and draft step functions have spent compiling (``engine.compile``)
        or capturing (``engine.cuda_graphs``) shapes at their first call, warm-up or not."""
        return _compile_s(self.verifier) + _compile_s(self.drafter)

    @property
    def pads_batches(self) -> bool:
        """Whether decode batches run padded to their bucket (``engine.pad_batches``; by default
        where the step functions are compiled or graph-captured, which need static shapes: an
        eager step of n rows computes n, not its bucket's, docs/design.md §5)."""
        pad = self.config.pad_batches
        return pad if pad is not None else self.config.compile or self.cuda_graphs

    @property
    def warmup_work(self) -> list[str]:
        """What :meth:`warmup` prepares that serving would otherwise pay for in its first
        requests: step shapes to compile (``engine.compile``) or capture (CUDA graphs), and the
        step costs adaptive k chooses by (without them it prices steps by a fixed model). Empty
        for an eager engine at a fixed k."""
        work = [
            ("steps compiled", self.config.compile),
            ("CUDA graphs captured", self.cuda_graphs),
            ("adaptive k's step costs measured", self.adaptive is not None),
        ]
        return [what for what, needed in work if needed]

    @property
    def needs_warmup(self) -> bool:
        """Whether :meth:`warmup` prepares anything serving would otherwise pay for (:attr:`warmup_work`)."""
        return bool(self.warmup_work)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the target's step functions replay CUDA graphs (the verifier's step mode)."""
        return getattr(self.verifier, "cuda_graphs", False)

    @property
    def warmup_s(self) -> float:
        """Seconds of warm-up, which tokens/s figures leave out: :meth:`warmup`'s, plus compiles
        and captures of step shapes first met while generating (a context whose block table
        doubles, a bucket the warm-up did not cover). Callers timing a run subtract the growth
        of this over the run from its wall time."""
        return self._warmup_wall_s + self.step_compile_s - self._step_compile_in_warmup_s

    @torch.no_grad()
    def warmup(self, batch_sizes: Sequence[int] | None = None, timed_steps: int = 3, cost_rounds: int = 3) -> float:
        """Compile (``engine.compile``) or capture (``engine.cuda_graphs``) the step functions for
        the batch buckets of ``batch_sizes`` (default: 1), and with adaptive k measure the cost
        of one decode step at every k = 0 .. k_max per bucket (:meth:`_measure_step_costs`).
        Runs throwaway requests of random tokens and leaves the engine as it was: no requests,
        metrics and timings untouched. Returns the seconds spent, also added to
        :attr:`warmup_s`, which tokens/s figures leave out."""
        if self.has_unfinished():
            raise RuntimeError("Engine.warmup needs an idle engine (no waiting or running requests).")
        t0, compile_s = time.perf_counter(), self.step_compile_s
        saved = self.metrics, self.times, self.k_chosen, self.depths_admitted, self.eos_ids
        self.eos_ids = set()  # run every throwaway request to its length
        self.metrics, self.times = SpecMetrics(), StepTimes()
        self.k_chosen, self.depths_admitted = collections.Counter(), collections.Counter()
        gen = torch.Generator().manual_seed(0)
        try:
            k_max = self.drafter.num_tokens
            ks = list(range(k_max + 1)) if self.adaptive is not None else [k_max]
            for bucket in sorted({bucket_for(b, self.config.batch_buckets) for b in (batch_sizes or [1])}):
                rows = min(bucket, self.config.max_num_seqs)
                fastest: dict[int, float] = {}  # k -> fastest step after the compiling ones (the fallback cost)
                for k in ks:  # every step shape of the bucket, compiled or captured at first use
                    self._forced_k = k
                    prompts = torch.randint(3, self.vocab_size, (rows, 8), generator=gen).tolist()
                    length = min((2 + timed_steps) * (k + 1) + 2, self.max_model_len - 9)
                    requests = [self.add_request(p, max_new_tokens=length) for p in prompts]
                    seconds = []
                    while any(not r.finished for r in requests) and len(seconds) < 3 + timed_steps:
                        t = time.perf_counter()
                        self.step()
                        seconds.append(time.perf_counter() - t)  # [prefill, compile, compile, timed ...]
                    for r in requests:
                        self.abort(r)
                    fastest[k] = min(seconds[3:] or seconds)
                if self.adaptive is not None:
                    samples, catch_ups, prompt_s = self._measure_step_costs(rows, ks, cost_rounds, gen)
                    measured = fit_step_costs(samples, k_max)
                    # a shallow k (0 < k < P) leaves each emitted token's position to a catch-up
                    later = statistics.median(catch_ups) if catch_ups else 0.0
                    shallow = [later if 0 < k < self.drafter.lookahead else 0.0 for k in ks]
                    self.adaptive.set_costs(bucket, [measured.get(k, fastest[k]) for k in ks], shallow, prompt_s)
        finally:
            self._forced_k = None
            self.metrics, self.times, self.k_chosen, self.depths_admitted, self.eos_ids = saved
        seconds = time.perf_counter() - t0
        self._warmup_wall_s += seconds
        self._step_compile_in_warmup_s += self.step_compile_s - compile_s
        return seconds

    def _measure_step_costs(
        self, rows: int, ks: Sequence[int], rounds: int, gen: torch.Generator
    ) -> tuple[dict[int, list[float]], list[float], float]:
        """Seconds of single decode steps at each k in ``ks`` for ``rows`` requests, one sample per
        round (:func:`fit_step_costs` makes costs of them), catch-up samples, and the drafter's
        seconds per prompt position over the requests' prompts (every depth). One set of
        requests with a realistic context (128 prompt tokens, at most a quarter of
        ``max_model_len``) steps through every k in each round, forward and backward in turn, so
        load that comes and goes on a shared machine weighs on every k alike; each k runs two
        steps and the second, which verifies k drafts and drafts k (a shallow round, whatever k
        ran before), is timed. Rounds cut short by the requests' length leave fewer samples
        (none: k is missing from the result). When the first step at a k runs every depth over
        the positions shallow rounds deferred (docs/design.md §2), its time beyond the second
        step's, per deferred position of a request, is a catch-up sample: seconds per position
        that every request of the batch defers."""
        prompt_len = max(8, min(128, self.max_model_len // 4))
        prompts = torch.randint(3, self.vocab_size, (rows, prompt_len), generator=gen).tolist()
        requests = [self.add_request(p, max_new_tokens=self.max_model_len - prompt_len - 1) for p in prompts]
        samples: dict[int, list[float]] = collections.defaultdict(list)
        catch_ups: list[float] = []
        forced = self._forced_k
        try:
            self._forced_k = max(ks)
            drafting_s = self.times.draft_s
            while any(not r.finished and r.num_computed < len(r.token_ids) - 1 for r in requests):
                self.step()  # prefill, drafting over the prompts
            prompt_s = (self.times.draft_s - drafting_s) / (rows * prompt_len)
            for rnd in range(rounds):
                for k in ks if rnd % 2 == 0 else ks[::-1]:
                    self._forced_k = k
                    stale = [self.drafter.stale_from(r.id) for r in requests]
                    seconds = []
                    for _ in range(2):
                        if any(r.finished for r in requests):
                            break
                        t = time.perf_counter()
                        self.step()
                        seconds.append(time.perf_counter() - t)
                    if len(seconds) < 2:
                        continue
                    samples[k].append(seconds[1])
                    caught_up = all(
                        s is not None and self.drafter.stale_from(r.id) is None for r, s in zip(requests, stale)
                    )
                    if caught_up:  # deferred positions per request, up to where the first step drafted over
                        behind = min(r.num_computed - s for r, s in zip(requests, stale) if s is not None)
                        catch_ups.append(max(0.0, seconds[0] - seconds[1]) / max(1, behind))
        finally:
            self._forced_k = forced
            for r in requests:
                self.abort(r)
        return dict(samples), catch_ups, prompt_s

    # ---------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """One engine step; returns the requests that finished in it.

        A step of decoding requests reads one tensor back to the host: the accepted counts,
        next tokens and drafts, to commit tokens, check stops and schedule (docs/design.md §5).
        """
        t0 = time.perf_counter()
        fwd0 = self.clock.seconds
        compiling = _compile_s(self.verifier), _compile_s(self.drafter)  # first calls of a shape: warm-up
        self._failed: list[Request] = []
        prefills, decodes = self._schedule()
        finished: list[Request] = list(self._failed)
        spans: list[DraftSpan] = []

        # target: prefill chunks, then verify [x[L-1], drafts] for decoding requests
        if prefills:
            for (r, c0, c1), hidden in zip(prefills, self._prefill(prefills)):
                r.num_computed = c1
                final = c1 == len(r.token_ids) - 1
                spans.append(
                    DraftSpan(
                        r, c0, hidden, None, self._num_drafts(r) if final else 0, r.slot or 0, depths=r.draft_depths
                    )
                )
        bucket = bucket_for(len(decodes), self.config.batch_buckets) if decodes else None  # of the decode batch
        if decodes:
            drafts = self._batch_drafts(decodes)
            pad_to = bucket if self.pads_batches else None  # None: exact rows and table widths
            verdict = self.verifier.verify(self.kv, decodes, drafts, self._run_target, pad_to=pad_to)
            # the step's one device -> host read: accepted counts, next tokens, the drafts (in as few
            # ops as it takes: on a GPU each is a launch beside the graphs)
            packed = torch.stack([verdict.num_accepted, verdict.next_tokens], 1)  # [B, 2]
            if drafts.tokens.shape[1]:
                packed = torch.cat([packed, drafts.tokens], 1)  # [B, 2 + k]
            rows = packed.tolist()
            counts = [r.num_pending for r in decodes]
            accepted = [row[0] for row in rows]
            self.metrics.record(counts, accepted)
            if self.adaptive is not None and self._forced_k is None:
                self.adaptive.observe(counts, accepted, [r.id for r in decodes])
            hiddens = verdict.hidden.unbind(0)  # one op for every row's [1 + k, H]
            for b, r in enumerate(decodes):
                a, n, L = accepted[b], counts[b], len(r.token_ids)
                r.num_verify_steps += 1
                r.num_draft_tokens += n
                r.num_accepted_tokens += a
                r.num_pending = r.pending_width = 0
                self._append(r, rows[b][2 : 2 + a] + [rows[b][1]])
                if r.finished:
                    finished.append(r)
                    continue
                r.num_computed = L + a
                spans.append(
                    DraftSpan(r, L - 1, hiddens[b], a, self._num_drafts(r), r.slot or 0, a + 1, r.draft_depths)
                )
        t1 = time.perf_counter()

        # draft (not for requests that stopped drafting)
        probes = self.adaptive.probes if self.adaptive is not None else 0
        spans = [
            s
            for s in spans
            if not cast(Request, s.request).drafting_off and (self.drafter.needs_hidden or s.num_drafts > 0)
        ]
        if spans:
            self._draft(spans, max(len(spans), len(decodes)))
        elif (
            self.adaptive is not None and bucket is not None and any(r.drafting_off and not r.finished for r in decodes)
        ):
            self.k_chosen[0] += 1  # every request still decoding has stopped drafting
            if self._forced_k is None:
                self.adaptive.plain_step(bucket)
        t2 = time.perf_counter()

        # bookkeeping: prefix cache, sliding windows, finished requests
        lookahead = self.drafter.lookahead
        for r in self.running:
            if r.finished:
                continue
            done = self._drafted_until(r, r.num_computed if r.lag_start is None else r.lag_start)
            final = len(r.token_ids) - lookahead
            self.kv.finalize(r.id, r.token_ids, min(r.num_computed, final), min(done, final))
            read_from = r.num_computed if r.drafting_off else done  # what the next forwards read
            self.kv.trim(r.id, max(0, read_from - max(0, lookahead - 1)))
        for r in finished:
            self._release(r)
        t3 = time.perf_counter()
        # compile / capture seconds of this step count as warm-up (warmup_s), not as step time
        verify_c, draft_c = _compile_s(self.verifier) - compiling[0], _compile_s(self.drafter) - compiling[1]
        self.times.verify_s += t1 - t0 - verify_c
        self.times.draft_s += t2 - t1 - draft_c
        self.times.bookkeeping_s += t3 - t2
        self.times.forward_s += self.clock.seconds - fwd0 - verify_c - draft_c
        self.times.num_steps += 1
        step_s = t3 - t0 - verify_c - draft_c
        if prefills:
            self.times.prompt_steps += 1
            self.times.prompt_s += step_s
        if self.adaptive is not None:
            self._time_probe(step_s, None if prefills else bucket, probed=self.adaptive.probes > probes)
        for obs in self.observers:
            obs.on_step_end(self, finished)
        return finished

    def _time_probe(self, seconds: float, bucket: int | None, probed: bool) -> None:
        """Adaptive k's measure of its probes as served (:meth:`AdaptiveK.note_probe_steps`): the
        seconds of a probe's drafting step and of the step that verifies its drafts, over the
        decayed mean of the bucket's decode steps that took no part in a probe. ``bucket``: the
        step's batch bucket, None for a step that prefilled (it measures nothing and drops a
        pending probe); warm-up's forced k measures nothing either."""
        assert self.adaptive is not None
        pair, self._probe_pair = self._probe_pair, None
        if bucket is None or self._forced_k is not None:
            return
        if pair is not None:  # this step verified the probe's drafts
            typical = self._typical_step_s.get(pair[0])
            if typical and pair[0] == bucket and not probed:
                self.adaptive.note_probe_steps(bucket, (pair[1] + seconds) / typical)
        elif probed:
            self._probe_pair = (bucket, seconds)
        else:
            mean = self._typical_step_s.get(bucket)
            self._typical_step_s[bucket] = seconds if mean is None else 0.95 * mean + 0.05 * seconds

    def _round_k(
        self, bucket: int, row_depths: Sequence[int], probe: bool = True, request: Request | None = None
    ) -> int:
        """k of this drafting round: the drafter's, or adaptive k's choice for the batch bucket
        whose rows keep ``row_depths`` (0: the row decodes plainly); ``probe``: whether a row
        keeps every depth, as a probe needs; ``request``: the round's one row at batch 1, whose
        own acceptance estimates then choose (:meth:`AdaptiveK.choose`)."""
        if self._forced_k is not None:
            return self._forced_k
        if self.adaptive is None:
            return self.drafter.num_tokens
        return self.adaptive.choose(bucket, row_depths, probe, None if request is None else request.id)

    def _probe_soon(self, bucket: int) -> bool:
        """Whether adaptive k probes ``bucket`` before a lag started now could outgrow
        :data:`LAG_LIMIT` (never while warm-up forces k: its requests are thrown away)."""
        if self.adaptive is None or self._forced_k is not None:
            return False
        return self.adaptive.steps_to_probe(bucket) <= LAG_LIMIT

    def _admits_plainly(self, r: Request, bucket: int, new_tokens: int) -> bool:
        """Whether ``r``, admitted into a batch of ``bucket`` to emit ``new_tokens``, decodes
        plainly for good (docs/design.md §5, adaptive k): where adaptive k's best at that bucket is 0, or where
        its remaining tokens could not earn back the drafter's pass over its prompt; but not when
        a probe falls due soon and no other running request drafts (one is enough to observe a
        probe, and each drafting request costs the probe a pass over its prompt and its lag). A
        request admitted plainly observes nothing, so without that exception the estimates that
        admitted it plainly could never change once every request is. The exception is left out
        where the bucket's best k drafts but one drafting row among plain ones could not pay: that
        request would only lag until the probe, which the whole batch pays for. Its prompt would
        be drafted over for nothing, and its chunks need not stop short for the drafter."""
        assert self.adaptive is not None
        if self.adaptive.best_k(bucket) != 0:
            if self.adaptive.drafting_pays_for(bucket, len(r.token_ids), new_tokens):
                return False
            if self.adaptive.best_k(bucket, [self.drafter.lookahead] + [0] * (bucket - 1)) == 0:
                # drafting alone among plain rows it would only lag until the probe, which the whole
                # batch pays for; where the rows draft together, admission decides, not probes
                return True
        return not self._probe_soon(bucket) or any(not other.drafting_off for other in self.running)

    def _admission_depths(self, r: Request, num_rows: int) -> int | None:
        """The MTP depths ``r``, admitted into a batch of ``num_rows``, drafts with (docs/design.md
        §6, depths per request); None: every depth. 0 where it decodes plainly
        (:meth:`_admits_plainly`), else the ``m`` of :meth:`AdaptiveK.depths_for`: fewer than P
        where its prompt pass and steps cost less so than they gain, and the number that running
        requests kept to fewer depths draft with unless another pays for the drafting round it
        adds to every step. Running requests whose depths were chosen for a smaller batch keep no
        more than ``r`` would alone (:meth:`_lower_running_depths`). A probe needs a row with
        every depth, so where one falls due within ``r``'s expected steps and no running request
        keeps every depth, ``r`` keeps them all."""
        if self.adaptive is None or self._forced_k is not None or not self.drafter.needs_hidden:
            return None
        bucket = bucket_for(num_rows, self.config.batch_buckets)
        r.depths_bucket = bucket
        new_tokens = r.max_new_tokens - len(r.output_token_ids)
        if self._admits_plainly(r, bucket, new_tokens):
            return 0
        self.adaptive.note_admission(len(r.token_ids))
        self._lower_running_depths(bucket, r, new_tokens)
        steps = new_tokens / self.adaptive.expected_tokens(self.adaptive.best_k(bucket))
        if self.adaptive.steps_to_probe(bucket) <= steps and not any(_keeps_every_depth(o) for o in self.running):
            return None
        # the groups a request keeps to fewer depths may join (those with every depth carry probes)
        running = {o.draft_depths for o in self.running if o.draft_depths is not None and not o.drafting_off}
        depths = self.adaptive.depths_for(bucket, len(r.token_ids), new_tokens, running)
        return None if depths >= self.drafter.lookahead else depths

    def _lower_running_depths(self, bucket: int, r: Request, new_tokens: int) -> None:
        """Running requests whose depths were chosen for a batch bucket below ``bucket`` keep no
        more than ``r``, admitted now to emit ``new_tokens``, keeps by itself (docs/design.md §6,
        depths per request). The first of a burst of requests is admitted alone and keeps the
        depths that pay at batch 1; in the larger batch each depth's steps cost more, yet every
        request admitted beside it kept the same depths only to share its drafting round (on a
        loopback server at concurrency 16, whole repeats at 4 depths: 1.04-1.07x plain decoding
        against 1.14-1.15x with lowering). Lowering costs nothing: the deeper depths stop running
        over the request and their blocks go back to the pool; raising would need them to pass
        over everything it has, so depths only ever go down. Probe carriers (every depth) keep
        theirs."""
        assert self.adaptive is not None
        chosen_below = [
            o
            for o in self.running
            if o.draft_depths is not None and not o.drafting_off and not o.finished and o.depths_bucket < bucket
        ]
        if not chosen_below:  # most admissions: nothing to price
            return
        depths = self.adaptive.depths_for(bucket, len(r.token_ids), new_tokens)
        for o in chosen_below:
            o.depths_bucket = bucket  # chosen for this bucket now
            m = cast(int, o.draft_depths)
            if depths < m:
                o.draft_depths = depths
                self.kv.drop_draft_depths(o.id, depths)
                self.drafter.limit_depths(o.id, depths)  # type: ignore[attr-defined]
                self.depths_lowered += 1

    def _draft(self, spans: list[DraftSpan], num_rows: int) -> None:
        """Propose the next drafts of ``spans`` into their requests' slots. With adaptive k at 0
        (docs/design.md §6), decode spans wait (the lag) and are drafted over with the next round
        that drafts; a request whose lag would outgrow :data:`LAG_LIMIT`, or whose prefill chunk
        comes with no probe due before its lag could fill, stops drafting for good. ``num_rows``:
        the step's batch (its verify rows), whose bucket adaptive k chooses for."""
        bucket = bucket_for(num_rows, self.config.batch_buckets)
        requests = [cast(Request, s.request) for s in spans]
        probe = any(_keeps_every_depth(r) for r in requests)
        # rows of the step that decode plainly: num_rows >= len(spans) (step())
        row_depths = [self._depths_kept(r) for r in requests] + [0] * (num_rows - len(spans))
        alone = requests[0] if num_rows == 1 and len(requests) == 1 else None  # batch 1: its own estimates
        k = self._round_k(bucket, row_depths, probe, alone)
        if k == 0 and self.drafter.needs_hidden:
            probe_soon = self._probe_soon(bucket)
            for s in spans:
                r = cast(Request, s.request)
                if s.num_accepted is None:  # a prefill chunk: drafted over (no drafts) only if probed soon
                    if not probe_soon:
                        self._stop_drafting(r, s.start)
                elif _lag_len(r) + s.new_positions > LAG_LIMIT:
                    self._stop_drafting(r, s.start)
                else:
                    if r.lag_start is None:
                        r.lag_start = s.start
                    assert s.hidden is not None
                    r.lag.append((s.hidden[: s.new_positions].clone(), s.new_positions))  # graph outputs get reused
            spans = [s for s in spans if s.num_accepted is None and not cast(Request, s.request).drafting_off]
        self.k_chosen[k] += 1
        # decode spans run one static round (compiled / graph-captured); prompt chunks another,
        # captured with CUDA graphs (padded to a width bucket) and eager otherwise; lags, of any
        # length, an eager one; so a request being admitted never sends the others' round eager
        static: list[DraftSpan] = []
        prompts: list[DraftSpan] = []
        dynamic: list[DraftSpan] = []
        for s in spans:
            lagging = cast(Request, s.request).lag_start is not None
            (dynamic if lagging else static if s.num_accepted is not None else prompts).append(s)
        if static:
            self._propose_into_slots(static, k, static=True)
        if prompts and getattr(self.drafter, "cuda_graphs", False):
            self._propose_into_slots(prompts, k, static=True)
        elif prompts:
            dynamic = prompts + dynamic
        if dynamic:
            self._propose_into_slots([_with_lag(s) for s in dynamic], k, static=False)

    def _depths_kept(self, r: Request) -> int:
        """The MTP depths ``r`` drafts with (:meth:`_admission_depths`; every one unless limited)."""
        return self.drafter.lookahead if r.draft_depths is None else r.draft_depths

    def _propose_into_slots(self, spans: list[DraftSpan], k: int, static: bool) -> None:
        """Drafting rounds over ``spans`` at ``k`` (at most a request's depths), one per round
        shape among them (``MtpDrafter.round_shape``: the drafts a row makes and the depths it
        runs, which the depths it keeps bound, :meth:`_admission_depths`), their drafts written
        into the requests' slots. ``static``: spans of one verify step each, at fixed widths (compiled /
        graph-captured) and padded to a batch bucket where the engine pads (:attr:`pads_batches`);
        else eager, any span length."""
        shape = getattr(self.drafter, "round_shape", None)  # MTP: rows of one (drafts, depths run)
        by_shape: dict[object, list[DraftSpan]] = {}
        for s in spans:
            by_shape.setdefault(shape(s, k) if shape is not None else s.depths, []).append(s)
        for group in by_shape.values():
            rows = bucket_for(len(group), self.config.batch_buckets) if self.pads_batches else len(group)
            pad_to = rows if static else None
            self._propose_round(group, k, pad_to)

    def _propose_round(self, spans: list[DraftSpan], k: int, pad_to: int | None) -> None:
        """One drafting round over ``spans`` at ``k`` (static shapes padded to ``pad_to`` rows, or
        None: eager, any span length), its drafts written into the requests' slots."""
        proposed = self.drafter.propose(
            spans, self.kv, self._run_draft, keep_logits=self.config.check_drafts, pad_to=pad_to, num_tokens=k
        )
        counts = proposed.host_counts()
        slot_ids = torch.tensor([s.slot for s in spans], device=self.device)
        width = proposed.tokens.shape[1]
        if width:
            full = self._draft_tokens.shape[1]
            self._draft_tokens.index_copy_(0, slot_ids, F.pad(proposed.tokens, (0, full - width)))
            if proposed.probs is not None:
                if self._draft_probs is None:
                    self._draft_probs = torch.zeros(
                        *self._draft_tokens.shape, proposed.probs.shape[-1], device=self.device
                    )  # [slots + 1, k, V]
                self._draft_probs.index_copy_(0, slot_ids, F.pad(proposed.probs, (0, 0, 0, full - width)))
        for b, s in enumerate(spans):
            r = cast(Request, s.request)
            r.num_pending, r.pending_width = counts[b], width
        if self.config.check_drafts:
            self._check_drafts(spans, proposed)

    # ---------------------------------------------------------------- schedule
    def _num_drafts(self, r: Request) -> int:
        """Drafts worth proposing for ``r``'s next verify step."""
        left = r.max_new_tokens - len(r.output_token_ids) - 1
        room = self.max_model_len - len(r.token_ids)
        return max(0, min(self.drafter.num_tokens, left, room))

    def _needs(self, r: Request, chunk_end: int | None) -> tuple[int, int]:
        """(target_end, draft_end) positions ``r`` writes this step."""
        k, P = self.drafter.num_tokens, self.drafter.lookahead
        extra = max(0, k - P)  # decode-step positions past a span
        L = len(r.token_ids)
        if r.drafting_off:  # stopped drafting: no new draft blocks
            return (L + r.num_pending if chunk_end is None else chunk_end), 0
        if chunk_end is None:  # verify
            n = r.num_pending
            return L + n, L + n + extra
        return chunk_end, chunk_end + (extra if chunk_end == L - 1 else 0)

    def _chunk_end(self, r: Request, budget: int) -> int | None:
        """End of ``r``'s next prefill chunk within ``budget`` tokens (None: ``r`` verifies
        next; ``num_computed``: no budget left). A drafting request's chunks other than the last
        end at least P - 1 positions before it, so their drafter inputs are all known."""
        c0, end = r.num_computed, len(r.token_ids) - 1
        if c0 >= end:
            return None
        if budget < 1:
            return c0
        lookahead = 0 if r.drafting_off else self.drafter.lookahead
        room = end - c0 - max(0, lookahead - 1)  # longest chunk that is not the last
        if end - c0 <= budget or room < 1:
            return end
        return c0 + min(budget, room)

    def _schedule(self) -> tuple[list[tuple[Request, int, int]], list[Request]]:
        budget = self.config.max_num_batched_tokens
        self._preempted_this_step = False
        prefills: list[tuple[Request, int, int]] = []
        decodes: list[Request] = []

        def take(r: Request, chunk_end: int | None) -> int:
            """Schedule ``r``'s chunk (or verify step); returns the target tokens it uses."""
            if chunk_end is not None:
                prefills.append((r, r.num_computed, chunk_end))
                return chunk_end - r.num_computed
            decodes.append(r)
            return 1 + r.num_pending

        for r in list(self.running):
            if r not in self.running:  # preempted by an earlier request of this loop
                continue
            chunk_end = self._chunk_end(r, budget)
            if chunk_end == r.num_computed or not self._allocate(r, chunk_end):
                continue  # no budget left for its prefill, or r was preempted
            budget -= take(r, chunk_end)
        while (
            self.waiting
            and len(self.running) < self.config.max_num_seqs
            and budget > 0
            and not self._preempted_this_step
        ):
            r = self.waiting[0]
            # the batch it will decode in: the running requests and every waiting one that fits
            r.draft_depths = self._admission_depths(
                r, min(self.config.max_num_seqs, len(self.running) + len(self.waiting))
            )
            r.num_computed = self.kv.add(r.id, r.token_ids, draft_depths=r.draft_depths)
            if r.draft_depths == 0:
                self._stop_drafting(r, r.num_computed)  # its drafter has no state
            chunk_end = self._chunk_end(r, budget)
            if not self.kv.ensure(r.id, *self._needs(r, chunk_end)):
                self.kv.free(r.id)
                self._forget_lag(r)  # decided again when next admitted
                if not self.running:
                    self.waiting.popleft()
                    self._fail(
                        r,
                        f"request {r.id} needs more KV cache blocks than the pool holds; "
                        f"raise kv.num_blocks or lower max_new_tokens.",
                    )
                    continue
                break
            self.waiting.popleft()
            self.depths_admitted[self._depths_kept(r)] += 1
            r.status = RequestStatus.RUNNING
            r.slot = self._free_slots.pop(0)
            self.running.append(r)
            budget -= take(r, chunk_end)
        return prefills, decodes

    def _allocate(self, r: Request, chunk_end: int | None) -> bool:
        """Blocks for ``r``'s work this step, preempting the latest-admitted requests if the pool
        runs dry. False if ``r`` itself was preempted."""
        while not self.kv.ensure(r.id, *self._needs(r, chunk_end)):
            if self.running == [r]:  # alone and still too big: it can never fit
                self._release(r)
                self._fail(
                    r,
                    f"request {r.id} needs more KV cache blocks than the pool holds "
                    f"({len(r.token_ids)} tokens so far); raise kv.num_blocks or lower max_new_tokens.",
                )
                return False
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _preempt(self, r: Request) -> None:
        """Drop ``r``'s cache; it is recomputed from its committed tokens later."""
        self.running.remove(r)
        self.kv.free(r.id)
        self.drafter.release(r.id)
        self._preempted_this_step = True
        r.num_computed, r.status = 0, RequestStatus.WAITING
        self._free_slot(r)
        r.num_preemptions += 1
        self.waiting.appendleft(r)

    # ------------------------------------------------------------------ forwards
    def _prefill(self, chunks: list[tuple[Request, int, int]]) -> list[torch.Tensor]:
        """Target over each chunk [c0, c1); returns hidden states [c1 - c0, H] per chunk. With
        CUDA graphs the chunks run as one captured step, padded to a batch bucket and a width
        bucket; otherwise eagerly (compiling every chunk shape would take minutes on a CPU)."""
        pad_to = bucket_for(len(chunks), self.config.batch_buckets) if self.cuda_graphs else None
        work = [(r.id, r.token_ids[c0:c1], c0) for r, c0, c1 in chunks]
        return self.verifier.prefill(self.kv, work, self._run_target, pad_to=pad_to)

    def _batch_drafts(self, decodes: list[Request]) -> Drafts:
        """The pending drafts of ``decodes`` from their slots: tokens [B, k] (k: the width they
        were drafted with) and, when a request samples, their distributions q [B, k, V]."""
        k = max(r.pending_width for r in decodes)
        sampled = self._draft_probs is not None and not all(r.sampling.greedy for r in decodes)
        if k == 0 and not sampled:  # plain decoding: nothing to gather or copy (on a GPU, 4 ops and 2 copies)
            none = self._no_drafts.get(len(decodes))
            if none is None:  # constant tensors (never written), made once per batch size
                none = self._no_drafts[len(decodes)] = Drafts.empty(len(decodes), self.device)
            return Drafts(none.tokens, none.num_drafts, counts=[0] * len(decodes))
        slot_ids = torch.tensor([r.slot for r in decodes], device=self.device)
        tokens = self._draft_tokens.index_select(0, slot_ids)[:, :k]  # [B, k]
        counts = [r.num_pending for r in decodes]
        probs = None
        if self._draft_probs is not None and not all(r.sampling.greedy for r in decodes):
            probs = self._draft_probs.index_select(0, slot_ids)[:, :k]  # [B, k, V]
            greedy = torch.tensor([r.sampling.greedy for r in decodes], device=self.device)
            one_hot = F.one_hot(tokens, probs.shape[-1]).to(probs.dtype)
            probs = torch.where(greedy[:, None, None], one_hot, probs)  # greedy rows: q one-hot at the draft
        return Drafts(tokens, torch.tensor(counts, device=self.device), probs, counts=counts)

    # ------------------------------------------------------------------ outputs
    def _append(self, r: Request, tokens: list[int]) -> None:
        """Commit ``tokens`` one by one, stopping at EOS, a stop string or a length limit."""
        for t in tokens:
            r.token_ids.append(int(t))
            if r.first_token_time is None:
                r.first_token_time = time.perf_counter()
            if int(t) in self.eos_ids:
                return self._finish(r, FinishReason.STOP)
            if r.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(r.output_token_ids)
                hit = [text.find(s) for s in r.stop if s in text]
                if hit:
                    return self._finish(r, FinishReason.STOP, text[: min(hit)])
            if len(r.output_token_ids) >= r.max_new_tokens or len(r.token_ids) >= self.max_model_len:
                return self._finish(r, FinishReason.LENGTH)

    def _finish(self, r: Request, reason: FinishReason, text: str | None = None) -> None:
        r.status, r.finish_reason, r.finish_time = RequestStatus.FINISHED, reason, time.perf_counter()
        if text is not None:
            r.text = text
        elif self.tokenizer is not None:
            r.text = self.tokenizer.decode(r.output_token_ids)

    def _fail(self, r: Request, message: str) -> None:
        self._failed.append(r)
        r.error = message
        r.status, r.finish_reason, r.finish_time = RequestStatus.FINISHED, FinishReason.ERROR, time.perf_counter()

    def _release(self, r: Request) -> None:
        if self.adaptive is not None:
            self.adaptive.finish_request(r.id)  # its acceptance counts enter the pool
        if r in self.running:
            self.running.remove(r)
        self.kv.free(r.id)
        self.drafter.release(r.id)
        self._free_slot(r)

    def _stop_drafting(self, r: Request, start: int) -> None:
        """``r`` decodes plainly from now on; its drafter's caches end at ``r.lag_start`` (its lag's
        start, else ``start``: the span it was not drafted over; earlier where a shallow round left
        a deeper depth's caches behind)."""
        r.lag_start = self._drafted_until(r, start if r.lag_start is None else r.lag_start)
        r.lag, r.drafting_off = [], True
        self.drafter.release(r.id)

    def _drafted_until(self, r: Request, end: int) -> int:
        """Where ``r``'s draft caches end, given that its drafter went as far as ``end``: earlier
        where a shallow round left a deeper depth's caches behind (docs/design.md §2)."""
        stale = self.drafter.stale_from(r.id)
        return end if stale is None else min(end, stale)

    def _free_slot(self, r: Request) -> None:
        """Give back ``r``'s slot and forget its pending drafts and lag."""
        if r.slot is not None:
            self._free_slots.append(r.slot)
            r.slot = None
        r.num_pending = r.pending_width = 0
        self._forget_lag(r)

    @staticmethod
    def _forget_lag(r: Request) -> None:
        """``r`` drafts again from its next span: no lag, drafting on."""
        r.lag, r.lag_start, r.drafting_off = [], None, False

    # ------------------------------------------------------------------ checks
    def _check_drafts(self, spans: Sequence[DraftSpan], proposed: Drafts) -> None:
        """Every draft against :func:`reference_draft_logits` (fresh, uncached, per request)."""
        atol = self.config.check_drafts_atol
        D = self.drafter.num_depths
        for b, span in enumerate(spans):
            n = int(proposed.num_drafts[b])
            if n == 0 or proposed.logits is None:
                continue
            r = span.request
            drafts = proposed.tokens[b, :n]
            ref = reference_draft_logits(
                self.model, torch.tensor(r.token_ids, device=self.device), drafts, self.drafter.lookahead, D
            )  # [n, V]
            mine = proposed.logits[b, :n]
            for s in range(n):
                diff = float((mine[s] - ref[s]).abs().max())
                d = int(drafts[s])
                greedy_off = r.sampling.greedy and float(ref[s].max() - ref[s][d]) > atol
                if diff > atol or greedy_off:
                    depth = s if s < self.drafter.lookahead else s % D
                    raise DraftCheckError(
                        f"check_drafts: request {r.id}, draft {s + 1} of {n} (depth {depth}) after "
                        f"{len(r.token_ids)} committed tokens: draft token {d}, reference argmax "
                        f"{int(ref[s].argmax())}, max |logit diff| {diff:.2e} > {atol:g}."
                    )


def _keeps_every_depth(r: Request) -> bool:
    """Whether ``r`` drafts with every depth of the drafter (a probe can draft k_max for it)."""
    return r.draft_depths is None and not r.drafting_off


def _lag_len(r: RequestLike) -> int:
    return sum(n for _, n in cast(Request, r).lag)


def _with_lag(span: DraftSpan) -> DraftSpan:
    """``span`` preceded by the positions its request's drafter skipped (adaptive k chose 0): one
    span from the lag's start, with the most re-prefill (always correct, docs/design.md §2)."""
    r = cast(Request, span.request)
    if r.lag_start is None:
        return span
    assert span.hidden is not None
    pieces = [h[:n] for h, n in r.lag] + [span.hidden[: span.new_positions]]
    hidden = torch.cat(pieces)  # [lag + new, H]
    start, r.lag, r.lag_start = r.lag_start, [], None
    return DraftSpan(r, start, hidden, 0, span.num_drafts, span.slot, len(hidden), span.depths)
