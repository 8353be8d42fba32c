"""Multi-depth MTP drafting with re-prefill (docs/design.md §2).

k = ``num_tokens`` drafts per verify step, D = depths, P = min(D, k) prefill steps.

After a verify step that accepted a' drafts, the new span is the accepted positions plus
r = max(0, P - 1 - a') earlier ones (re-prefill: depth s wrote its last s positions from this
round's drafts, and the last s - a' of them are now wrong). Prefill step s runs depth s over
the whole span (hidden states of step s-1, tokens shifted s+1) and drafts from its last
position; decode steps s = P .. k-1 (only when k > D) run depth s % D on one new position,
advancing by one. A decode step sees its depth's state at the span and at the positions that
depth itself wrote this round; the positions it skipped are invalidated (absent), so drafts
are a pure function of the committed tokens and the earlier drafts (``check_drafts``).

A round that wants fewer drafts than P (adaptive k) is *shallow* when it can be: it runs only
depths ``0 .. k-1`` and keeps the span's target hidden states, so the deeper depths run over
those positions later, in one span from the first deferred position, at the first round that
needs them (docs/design.md §2). A request limited to ``m < P`` depths (adaptive k's admission,
``DraftSpan.depths``) drafts as if the drafter had only those: at most ``m`` drafts, and the
deeper depths never run over it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from inkfw.errors import ConfigError
from inkfw.kernels import Kernels
from inkfw.speculative.draft_view import DraftView
from inkfw.speculative.interfaces import Drafts, DraftSpan, ForwardRunner, KVManager, TargetModel, TokenSampler
from inkfw.speculative.observers import run_directly
from inkfw.speculative.sampling import Sampler
from inkfw.speculative.step import (
    MIN_PREFILL_WIDTH,
    StepBuffers,
    StepFunction,
    StepModes,
    flat_tables,
    prefill_width,
    table_views,
    table_width,
)

DEFER_LIMIT = 256  # positions a request's deeper depths may fall behind in shallow rounds


@dataclass
class _Deferred:
    """Positions ``first .. next_start - 1`` of a request over which depths ``>= level`` have not
    run (shallow rounds): their target hidden states, in order, for the span that runs them."""

    first: int
    level: int
    rows: list[torch.Tensor]  # [n_i, H] each, positions first .. in order


@dataclass
class _RowState:
    next_start: int  # first position not drafted over yet
    tail_len: int  # valid rows at the end of the request's tail (<= P - 1)
    deferred: _Deferred | None = None  # positions the deeper depths have not run over yet


class MtpDrafter(StepModes):
    """``inkfw/conf/drafter/mtp.yaml``. Per request it keeps, on the device, the target hidden
    states of the last P - 1 positions it drafted over (the re-prefill tail, one row of
    ``tail`` per request slot); on the host, where the next span starts. A round reads nothing
    back to the host: spans, positions and block tables are built from host values and copied
    into persistent buffers, and the round itself is one function of tensors
    (:meth:`round`), compiled or graph-captured by the engine's choice (:meth:`set_step_mode`)."""

    needs_hidden = True

    def __init__(
        self,
        model: TargetModel,
        num_tokens: int | None = None,
        num_depths: int | None = None,
        sampler: TokenSampler | None = None,
        kernels: Kernels | None = None,
        defer_limit: int = DEFER_LIMIT,
        **_: object,
    ):
        view = DraftView.from_config(
            model.cfg, num_depths if num_depths is not None else model.num_mtp_depths, num_tokens
        )
        if view.depths > model.num_mtp_depths:
            raise ValueError(f"model has {model.num_mtp_depths} MTP depths, drafter wants {view.depths}")
        self.model = model
        self.num_tokens = view.num_draft_tokens
        self.num_depths = view.depths
        self.lookahead = view.prefill_steps  # P
        self.sampler = sampler or Sampler()
        self.kernels = kernels or Kernels("torch")
        if not isinstance(defer_limit, int) or isinstance(defer_limit, bool) or defer_limit < 0:
            raise ConfigError(
                f"drafter.defer_limit must be an integer >= 0 (0: every round runs all P depths), got {defer_limit!r}."
            )
        self.defer_limit = defer_limit
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._rows: dict[Hashable, _RowState] = {}
        self.tail = torch.zeros(
            1, max(0, self.lookahead - 1), model.cfg.hidden_size, dtype=self.dtype, device=self.device
        )
        self.buffers = StepBuffers(self.device)

    # ------------------------------------------------------------------ setup
    def reserve(self, num_slots: int) -> None:
        """Room for request slots ``0 .. num_slots - 1`` (+ a scratch row for padding)."""
        if self.tail.shape[0] < num_slots + 1:
            tail = self.tail.new_zeros(num_slots + 1, *self.tail.shape[1:])
            tail[: self.tail.shape[0] - 1] = self.tail[:-1]
            self.tail = tail

    def release(self, rid: Hashable) -> None:
        self._rows.pop(rid, None)

    def limit_depths(self, rid: Hashable, depths: int) -> None:
        """Request ``rid`` drafts with depths ``0 .. depths - 1`` only from now on (its spans say
        so, ``DraftSpan.depths``): positions deferred for deeper depths alone need no catch-up."""
        state = self._rows.get(rid)
        if state is not None and state.deferred is not None and state.deferred.level >= depths:
            state.deferred = None

    def next_start(self, rid: Hashable) -> int | None:
        """First position request ``rid``'s next span must start at (None: not seen yet)."""
        state = self._rows.get(rid)
        return None if state is None else state.next_start

    def stale_from(self, rid: Hashable) -> int | None:
        """First position from which a depth's cache of ``rid`` may not be whole yet (shallow
        rounds deferred it); None: every depth is whole up to :meth:`next_start`."""
        state = self._rows.get(rid)
        return None if state is None or state.deferred is None else state.deferred.first

    def round_shape(self, span: DraftSpan, num_tokens: int | None = None) -> tuple[int, int, bool]:
        """(drafts, depths run, catches up) of ``span``'s row in a round at ``num_tokens`` (default
        k); rows of one shape draft in one round (:meth:`propose`). A row kept to ``m < P`` depths
        drafts at most ``m``. One that keeps more depths than it drafts runs only the depths that
        draft where it can defer the others (:meth:`_can_defer`; a *shallow* row), all it keeps
        otherwise. So a probe's carrier drafting k < P shares the round of the rows kept to k
        depths. A row catches up where depths that run have not run over some of its positions
        (it re-spans from the first: a round of any span length, eager), so it drafts apart from
        rows that do not."""
        P = self.lookahead
        top = P if span.depths is None else span.depths
        K = self.num_tokens if num_tokens is None else num_tokens
        if top < P:  # limited rows draft no more than their depths (no decode steps)
            K = min(K, top)
        state = self._rows.get(span.request.id) or _RowState(span.start, 0)
        depths_run = K if top > K and self._can_defer(state, span.new_positions) else top
        return K, depths_run, state.deferred is not None and state.deferred.level < depths_run

    def _can_defer(self, state: _RowState, new_positions: int) -> bool:
        """Whether a row may skip its deeper depths this round: its deferred positions (counting
        the tail it would keep) stay within ``defer_limit``."""
        d = state.deferred
        behind = state.tail_len if d is None else state.next_start - d.first
        return behind + new_positions <= self.defer_limit

    # ------------------------------------------------------------------ a round
    @torch.no_grad()
    def propose(
        self,
        spans: Sequence[DraftSpan],
        kv: KVManager,
        run: ForwardRunner = run_directly,
        keep_logits: bool = False,
        pad_to: int | None = None,
        num_tokens: int | None = None,
    ) -> Drafts:
        """Drafts for ``spans`` (docs/design.md §2): ``num_tokens`` (default k) per row at most,
        in a batch padded to ``pad_to`` rows (padding rows compute and write nothing that is
        read). ``pad_to`` also marks the round static (spans of one verify step each): only
        those run compiled or as CUDA graphs; others (after prefill chunks, catch-ups of deferred
        depths) run eagerly. Every row has one :meth:`round_shape` (the engine groups them): a
        row drafts ``num_tokens`` < P running depths ``0 .. num_tokens - 1`` only where it can
        defer the others (:meth:`_can_defer`), beside rows that keep just as many; otherwise all
        its depths run and its deferred positions catch up. Rows limited to ``m < P`` depths
        (``DraftSpan.depths``) take ``m`` in place of P, and k at most ``m``. Returns the first
        ``len(spans)`` rows."""
        P = self.lookahead
        tops = [P if s.depths is None else s.depths for s in spans]  # the depths each row drafts with
        assert set(tops) <= set(range(1, P + 1)), f"rows of depths {set(tops)}"
        shapes = [self.round_shape(s, num_tokens) for s in spans]
        assert len({shape[:2] for shape in shapes}) <= 1, f"one round over rows of one shape, got {set(shapes)}"
        K, depths_run = shapes[0][:2] if shapes else (self.num_tokens if num_tokens is None else num_tokens, P)
        defers = [top > depths_run for top in tops]  # shallow for this row: depths >= K wait
        # a row re-spans from its first deferred position where the depths that run include some
        # that have not run over it (docs/design.md §2)
        respans = [catches_up for _, _, catches_up in shapes]
        self.reserve(max((s.slot for s in spans), default=0) + 1)
        scratch = self.tail.shape[0] - 1
        states = [self._rows.get(s.request.id) or _RowState(s.start, 0) for s in spans]
        if any(respans):
            pad_to = None  # spans of any length: an eager round
        B = max(len(spans), pad_to or 0)

        # ---- host: each row's span (re-prefilled positions + the new ones), read from host values
        slots, starts, lengths, takes, wants, draft_at, rids = [], [], [], [], [], [], []
        hiddens: list[torch.Tensor] = []  # [>= length - take, H] per row: the span's rows past its tail ones
        for span, state, respan, shallow in zip(spans, states, respans, defers):
            rid = span.request.id
            assert span.start == state.next_start, (
                f"request {rid}: span starts at {span.start}, drafter expected {state.next_start}"
            )
            assert span.hidden is not None
            n, deferred = span.new_positions, state.deferred
            if respan:  # one span from the first deferred position, no re-prefill
                assert deferred is not None
                hidden = torch.cat([*deferred.rows, span.hidden[:n]])  # [deferred + n, H], a copy
                start, r = deferred.first, 0
                if shallow:  # depths >= K still lag: keep every row, as the one tensor just built
                    deferred.rows, deferred.level = [hidden], K
                self._rows[rid] = _RowState(span.start + n, min(P - 1, len(hidden)), deferred if shallow else None)
            else:
                hidden = span.hidden
                # re-prefill what the depths that run now wrote from rejected drafts last round: a row
                # without re-span ran at least these depths then (deeper ones wait in its deferred span)
                a = span.num_accepted
                r = 0 if a is None else min(max(0, depths_run - 1 - a), state.tail_len)
                start = span.start - r
                if shallow:  # keep what the deeper depths will need: the tail's rows, then the new ones
                    if deferred is None:
                        tail = self.tail[span.slot, P - 1 - state.tail_len :]  # positions start - tail_len ..
                        deferred = _Deferred(span.start - state.tail_len, K, [tail.clone()])
                    deferred.level = K
                    deferred.rows.append(span.hidden[:n].clone())  # graph outputs get reused
                self._rows[rid] = _RowState(span.start + n, min(P - 1, state.tail_len + n), deferred)
            slots.append(span.slot)
            starts.append(start)
            lengths.append(span.start + n - start)
            takes.append(r)
            hiddens.append(hidden)
            wants.append(min(span.num_drafts, K))
            draft_at.append(len(span.request.token_ids) - start - 1)  # ext index of d_1 = x[L]
            rids.append(rid)
        # static batches pad spans and hidden rows to this round's K + 1 where every span fits (the
        # verify before ran at K: fixed k, adaptive k that kept it), else to the drafter's k + 1 >=
        # any span after a verify step (docs/design.md §2); prompt chunks (CUDA graphs only) to
        # their width bucket. At most two shapes per (bucket, K)
        widest = max(lengths)
        if pad_to is None:
            static_width = 0
        elif widest <= K + 1:
            static_width = K + 1
        elif widest <= self.num_tokens + 1:
            static_width = self.num_tokens + 1
        else:  # prompt chunks
            static_width = prefill_width(widest)
        # a greedy round over spans of any length, compiled, runs each depth over the span as a graph
        # of symbolic shapes (with CUDA graphs only re-spans and lags are such rounds: they stay eager,
        # as captured graphs and symbolic shapes are combined nowhere else). Its spans are at least 16
        # wide: dynamo specialises a width of 1 (and some depths' graphs test T != 2), so shorter
        # spans would compile graphs of their own
        greedy = all(s.request.sampling.greedy for s in spans)
        tensor_ops_only = greedy and not keep_logits  # no draws, no logits kept: a round of tensor ops
        by_depth = self._compile and not self._cuda_graphs and pad_to is None and tensor_ops_only
        T = max(widest, static_width, MIN_PREFILL_WIDTH if by_depth else 1)
        longest = max(len(h) for h in hiddens)  # hidden rows of the longest span
        # a static round's hidden rows are cut or padded to its width: a span reads only its n new
        # rows (n <= length <= width), and a verify wider than the round (k_prev > K) must not add
        # a third shape (K + 1 spans beside k_prev + 1 hidden rows: a compile mid-run)
        Th = static_width if pad_to is not None else longest
        E = T + max(K, P)  # ext width: depth s reads ext[:, s : s + T], drafts land up to T + K
        ext = []
        for span, start in zip(spans, starts):
            known = span.request.token_ids[start + 1 : start + 1 + E]  # ext[b, i] = x[start + 1 + i]
            ext.append(known + [0] * (E - len(known)))
        pad = B - len(spans)
        slots += [scratch] * pad
        starts += [0] * pad
        lengths += [0] * pad
        takes += [0] * pad
        wants += [0] * pad
        draft_at += [0] * pad
        ext += [[0] * E] * pad
        ends = [s + n - 1 for s, n in zip(starts, lengths)]
        # decode spans all hold their verify's k + 1 rows: one stack (a pad per row otherwise)
        same = all(len(h) == longest for h in hiddens)
        rows = torch.stack(hiddens) if same else pad_sequence(list(hiddens), batch_first=True)  # [n, longest, H]
        hidden = F.pad(rows[:, :Th], (0, 0, 0, max(0, Th - longest), 0, pad))  # [B, Th, H]

        # a static round's inputs live in persistent buffers (one set per shape: what graph replay
        # needs); a round of any span length gets its own, dropped after it, or the drafter would
        # keep a [B, T, H] buffer for every span length it ever met
        buffers = self.buffers if pad_to is not None else StepBuffers(self.device)
        stage = buffers.stage
        # decode positions are computed here on the host: positions computed inside a compiled graph
        # next to the cache's slot-tag writes miscompiled on CPU (torch 2.13 inductor)
        n_dec = max(0, K - P)
        rows_t = [
            stage("slots", slots),
            stage("starts", starts),
            stage("takes", takes),
            stage("lengths", lengths),
            stage("decode_positions", [[e + 1 + i for i in range(n_dec)] for e in ends]),
            stage("decode_valid", [[i < w - P for i in range(n_dec)] for w in wants]),  # 0 / 1: one dtype, one copy
            stage("ext", ext),
            stage("draft_at", draft_at),
            stage("wants", wants),
        ]
        table_args = []
        last_end = [e + 1 + max(0, w - P) if n else 0 for e, n, w in zip(ends, lengths, wants)]
        for d in range(depths_run):  # K > P: depths_run = P = D
            table_args += flat_tables(
                kv.step_tables(
                    kv.group_indices(d), rids + [None] * pad, starts, last_end, width=table_width, stage=stage
                )
            )
        args = (stage("hidden", hidden, hidden.dtype), *rows_t, *table_args)
        buffers.flush()  # the staged host values (all integers): one copy

        probs = logits = None
        if tensor_ops_only:  # static rounds compiled / graph-captured; others by depth or eager
            round_fn = (
                self._round_function(kv, K, depths_run, len(table_args))
                if pad_to is not None
                else partial(self.round, kv, K, depths_run, None, by_depth)
            )
            tokens = run(round_fn, *args)
        else:
            chooser = _SampledChooser(self.sampler, spans, wants, keep_logits, pad)
            tokens = run(self.round, kv, K, depths_run, chooser, False, *args)
            probs = chooser.stacked_probs(tokens) if not greedy else None
            logits = chooser.stacked_logits() if keep_logits else None
        n = len(spans)
        return Drafts(
            tokens[:n],
            torch.tensor(wants[:n], device=self.device),
            probs[:n] if probs is not None else None,
            logits[:n] if logits is not None else None,
            counts=wants[:n],
        )

    def _round_function(self, kv: KVManager, K: int, depths_run: int, num_table_args: int) -> StepFunction:
        def greedy_round(*args: torch.Tensor) -> torch.Tensor:
            return self.round(kv, K, depths_run, None, False, *args)

        name = f"draft-round-k{K}" + ("" if depths_run == self.lookahead else "-shallow")
        return self._step_function((K, depths_run, num_table_args), greedy_round, name, tables_from=10)

    def _span_depth_function(self, kv: KVManager, depth: int, num_table_args: int) -> StepFunction:
        """:meth:`span_depth` as a step function with the batch and span width symbolic (rounds
        over spans of any length: prompt chunks, lags, catch-ups), one per depth."""

        def span_depth_step(*args: torch.Tensor) -> torch.Tensor:
            return self.span_depth(kv, depth, *args)

        # g [B, T, H], ext [B, T + max(K, P)], positions / valid [B, T], then tables [B, W] / bases [B]
        dims = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]
        for i in range(4, 4 + num_table_args):
            dims += [(i, 0), (i, 1)] if i % 2 == 0 else [(i, 0)]
        return self._step_function(
            ("span", depth, num_table_args), span_depth_step, f"span-depth-{depth}", 4 + num_table_args, dims
        )

    def span_depth(
        self, kv: KVManager, depth: int, g: torch.Tensor, ext: torch.Tensor, *args: torch.Tensor
    ) -> torch.Tensor:
        """Prefill step ``depth`` of a round: the depth over the span, from the hidden states g
        [B, T, H] of the step before and the tokens ``ext[:, depth : depth + T]``; ``args``:
        positions [B, T], valid [B, T], then the depth's table arguments. Returns g [B, T, H]."""
        positions, valid, *tables = args
        T = g.shape[1]
        cache = kv.caches_from(table_views(kv.group_indices(depth), tables), positions, valid, draft_depth=depth)[0]
        depth_input = self.kernels.mtp_depth_input if self.kernels.fused else None  # else the depth's modules
        return self.model.mtp_step(depth, g, ext[:, depth : depth + T], positions, cache, depth_input)

    def round(
        self,
        kv: KVManager,
        K: int,
        depths_run: int,
        chooser: _SampledChooser | None,
        by_depth: bool,
        *args: torch.Tensor,
    ) -> torch.Tensor:
        """One drafting round over staged tensors (see :meth:`propose`): prefill steps of depths
        ``0 .. depths_run - 1`` (P, or K in a shallow round), then decode steps up to K; tensor
        ops only when ``chooser`` is None (greedy). ``by_depth``: each prefill step runs as its
        own step function (:meth:`_span_depth_function`, compiled with symbolic shapes), the
        rest eagerly; for rounds of any span length, which one compiled graph per shape would
        not serve. Returns draft tokens [B, K]."""
        model, P, D = self.model, depths_run, self.num_depths
        hidden, slots, starts, takes, lengths, decode_positions, decode_valid, ext, draft_at, wants = args[:10]
        decode_valid = decode_valid.bool()  # staged as integers, with the round's other host values
        tables = args[10:]
        B, T = ext.shape[0], ext.shape[1] - max(K, self.lookahead)  # the span width (ext: T + max(K, lookahead))
        device = hidden.device
        rows = torch.arange(B, device=device)
        # the span's hidden rows (re-prefilled tail rows, then the new ones) and the slot's new tail
        g, positions, valid, last = self.kernels.prepare_draft_spans(
            self.tail, hidden, slots, starts, takes, lengths, width=T
        )  # [B, T, H], [B, T], [B, T], [B]

        def depth_table_args(d: int) -> tuple[torch.Tensor, ...]:  # the table arguments of depth d's groups
            at = 2 * sum(len(kv.group_indices(e)) for e in range(d))
            return tables[at : at + 2 * len(kv.group_indices(d))]

        def depth_tables(d: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
            return table_views(kv.group_indices(d), depth_table_args(d))

        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        depth_input = self.kernels.mtp_depth_input if self.kernels.fused else None  # else the depth's modules

        def choose(step: int, logits: torch.Tensor) -> None:  # logits [B, V] -> drafts[:, step], written into ext
            tok = logits.argmax(-1) if chooser is None else chooser(step, logits)
            tokens[:, step] = tok
            at = (draft_at + step).clamp(max=ext.shape[1] - 1)
            ext[rows, at] = torch.where(wants > step, tok, ext[rows, at])

        # ---- prefill steps: depth s over the whole span (every round, so each depth's cache stays whole;
        # a shallow round's deeper depths run over its positions in a later round's span)
        for s in range(P):
            table_args = depth_table_args(s)
            span_depth = (
                self._span_depth_function(kv, s, len(table_args)) if by_depth else partial(self.span_depth, kv, s)
            )
            g = span_depth(g, ext, positions, valid, *table_args)  # [B, T, H]
            if s < K:
                choose(s, model.logits(g[rows, last]))

        # ---- decode steps (k > D): one position per step, depth s % D; positions this round skips are
        # forgotten first, so every draft is a pure function of the committed tokens and earlier drafts
        if K > P:
            for d in range(D):  # decode_positions [B, K - P]: after the span's end; valid where drafted
                kv.forget_from(depth_tables(d), decode_positions, decode_valid)
            g_last = g[rows, last][:, None]  # [B, 1, H]
            for s in range(P, K):
                pos = decode_positions[:, s - P : s - P + 1]  # [B, 1]
                active = decode_valid[:, s - P : s - P + 1]  # [B, 1]: wants > s
                cache = kv.caches_from(depth_tables(s % D), pos, active, draft_depth=s % D)[0]
                g_last = model.mtp_step(s % D, g_last, tokens[:, s - 1 : s], pos, cache, depth_input)
                choose(s, model.logits(g_last[:, 0]))
        return tokens


class _SampledChooser:
    """Draft choice for batches with sampled requests (eager): argmax for greedy rows, a draw
    from the request's generator for sampled rows; keeps q (and raw logits when asked)."""

    def __init__(
        self, sampler: TokenSampler, spans: Sequence[DraftSpan], wants: list[int], keep_logits: bool, pad: int
    ):
        self.sampler, self.keep_logits = sampler, keep_logits
        self.params = [s.request.sampling for s in spans] + [spans[0].request.sampling] * pad
        self.generators = [s.request.generator for s in spans]
        self.wants = wants
        self.any_sampled = any(not p.greedy for p in self.params)
        self.probs: dict[int, torch.Tensor] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def __call__(self, step: int, logits: torch.Tensor) -> torch.Tensor:
        tok = logits.argmax(-1)
        if self.keep_logits:
            self.logits[step] = logits.float()
        if self.any_sampled:
            q = self.sampler.probs(logits, self.params)  # [B, V]
            sampled = [
                b for b, p in enumerate(self.params[: len(self.generators)]) if not p.greedy and step < self.wants[b]
            ]
            if sampled:
                idx = torch.tensor(sampled, device=logits.device)
                draws = self.sampler.sample(q[idx], [self.generators[b] for b in sampled])
                tok = tok.index_copy(0, idx, draws)
            self.probs[step] = q
        return tok

    def stacked_probs(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """q [B, K, V]: the processed distribution of each draft, one-hot for greedy rows; None
        for a round of no drafts (K = 0: adaptive k's pass over a prompt chunk kept for a probe)."""
        if not self.probs:
            return None
        V = next(iter(self.probs.values())).shape[-1]
        one_hot = F.one_hot(tokens, V).float()  # [B, K, V]
        q = torch.stack([self.probs.get(i, one_hot[:, i]) for i in range(tokens.shape[1])], dim=1)
        greedy_rows = torch.tensor([p.greedy for p in self.params], device=tokens.device)
        return torch.where(greedy_rows[:, None, None], one_hot, q)

    def stacked_logits(self) -> torch.Tensor | None:
        if not self.logits:
            return None
        like = next(iter(self.logits.values()))
        K = max(self.logits) + 1
        return torch.stack([self.logits.get(i, torch.zeros_like(like)) for i in range(K)], dim=1)
