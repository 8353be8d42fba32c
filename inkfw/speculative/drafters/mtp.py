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
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inkfw.speculative.draft_view import DraftView
from inkfw.speculative.interfaces import Drafts, DraftSpan, ForwardRunner, KVManager, TargetModel, TokenSampler
from inkfw.speculative.observers import run_directly
from inkfw.speculative.sampling import Sampler


@dataclass
class _RowState:
    next_start: int  # first position not processed yet
    tail: torch.Tensor  # [<= P-1, H] target hidden states of the positions just before next_start


class MtpDrafter:
    needs_hidden = True

    def __init__(
        self,
        model: TargetModel,
        num_tokens: int | None = None,
        num_depths: int | None = None,
        sampler: TokenSampler | None = None,
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
        self._rows: dict[Hashable, _RowState] = {}

    def release(self, rid: Hashable) -> None:
        self._rows.pop(rid, None)

    @torch.no_grad()
    def propose(
        self, spans: Sequence[DraftSpan], kv: KVManager, run: ForwardRunner = run_directly, keep_logits: bool = False
    ) -> Drafts:
        model, k, D, P = self.model, self.num_tokens, self.num_depths, self.lookahead
        device = next(model.parameters()).device
        B = len(spans)
        rids = [s.request.id for s in spans]

        # ---- the span of each row: re-prefilled positions + the new ones
        hidden_rows, starts = [], []
        for span in spans:
            assert span.hidden is not None, "MTP drafting needs the target's hidden states"
            state = self._rows.get(span.request.id)
            if state is None:
                state = _RowState(span.start, span.hidden[:0])
            assert span.start == state.next_start, (
                f"request {span.request.id}: span starts at {span.start}, drafter expected {state.next_start}"
            )
            r = 0 if span.num_accepted is None else min(max(0, P - 1 - span.num_accepted), len(state.tail))
            hidden_rows.append(torch.cat([state.tail[len(state.tail) - r :], span.hidden]))  # [T_b, H]
            starts.append(span.start - r)
            both = torch.cat([state.tail, span.hidden])
            self._rows[span.request.id] = _RowState(span.start + len(span.hidden), both[max(0, len(both) - (P - 1)) :])
        lengths = [len(h) for h in hidden_rows]
        T = max(lengths)
        ar = torch.arange(T)
        start_t = torch.tensor(starts)
        len_t = torch.tensor(lengths)
        valid = (ar[None, :] < len_t[:, None]).to(device)  # [B, T]
        positions = (start_t[:, None] + torch.minimum(ar[None, :], (len_t - 1)[:, None])).to(device)  # [B, T]
        g = torch.stack([F.pad(h, (0, 0, 0, T - len(h))) for h in hidden_rows]).to(device)  # [B, T, H]
        ends = [s + n - 1 for s, n in zip(starts, lengths)]  # last position of each span

        # ext[b, i] = x[start_b + 1 + i]; drafts are written in as they are sampled
        ext = torch.zeros(B, T + k, dtype=torch.long)
        for b, span in enumerate(spans):
            known = span.request.token_ids[starts[b] + 1 : starts[b] + 1 + T + k]
            ext[b, : len(known)] = torch.tensor(known, dtype=torch.long)
        ext = ext.to(device)
        want = torch.tensor([s.num_drafts for s in spans])  # [B]
        draft_at = torch.tensor(
            [len(s.request.token_ids) - starts[b] - 1 for b, s in enumerate(spans)], device=device
        )  # ext index of d_1 = x[L]
        rows = torch.arange(B, device=device)
        last = (len_t - 1).to(device)

        tokens = torch.zeros(B, k, dtype=torch.long, device=device)
        probs: list[torch.Tensor | None] = [None] * k
        logits_kept: list[torch.Tensor | None] = [None] * k

        params = [s.request.sampling for s in spans]
        any_sampled = any(not p.greedy for p in params)
        wanted = want.tolist()
        want_dev = want.to(device)
        most = max(wanted)

        def choose(step: int, logits: torch.Tensor) -> None:  # logits [B, V] -> drafts[:, step]
            tok = logits.argmax(-1)
            if any_sampled:
                q = self.sampler.probs(logits, params)  # [B, V]
                sampled = [b for b, p in enumerate(params) if not p.greedy and step < wanted[b]]
                if sampled:
                    idx = torch.tensor(sampled, device=device)
                    gens = [spans[b].request.generator for b in sampled]
                    tok = tok.index_copy(0, idx, self.sampler.sample(q[idx], gens))
                probs[step] = q
            tokens[:, step] = tok
            if keep_logits:
                logits_kept[step] = logits.float()
            at = (draft_at + step).clamp(max=T + k - 1)
            ext[rows, at] = torch.where(want_dev > step, tok, ext[rows, at])

        # ---- prefill steps: depth s over the whole span
        for s in range(P):
            cache = kv.draft_cache(s, rids, positions, valid)
            g = run(model.mtp_step, s, g, ext[:, s : s + T], positions, cache)  # [B, T, H]
            if most > s:
                choose(s, run(model.logits, g[rows, last]))

        # ---- decode steps (k > D): one position per step, depth s % D
        if most > P:
            for b, span in enumerate(spans):
                if wanted[b] > P:
                    kv.invalidate_draft(span.request.id, ends[b] + 1, ends[b] + 1 + wanted[b] - P)
            g_last = g[rows, last][:, None]  # [B, 1, H]
            ends_t = torch.tensor(ends, device=device)
            for s in range(P, min(k, most)):
                active = (want_dev > s)[:, None]  # [B, 1]
                pos = (ends_t + (s - P + 1))[:, None]  # [B, 1]
                cache = kv.draft_cache(s % D, rids, pos, active)
                g_last = run(model.mtp_step, s % D, g_last, tokens[:, s - 1 : s], pos, cache)
                choose(s, run(model.logits, g_last[:, 0]))

        num = want.clamp(max=k).to(device)
        q_all = None
        if any(p is not None for p in probs):
            V = next(p for p in probs if p is not None).shape[-1]
            q_all = torch.stack(
                [p if p is not None else F.one_hot(tokens[:, i], V).float() for i, p in enumerate(probs)], dim=1
            )  # [B, k, V]
            greedy_rows = torch.tensor([p.greedy for p in params], device=device)
            q_all = torch.where(greedy_rows[:, None, None], F.one_hot(tokens, V).float(), q_all)
        logits_all = None
        if keep_logits and any(x is not None for x in logits_kept):
            like = next(x for x in logits_kept if x is not None)
            logits_all = torch.stack([x if x is not None else torch.zeros_like(like) for x in logits_kept], dim=1)
        return Drafts(tokens, num, q_all, logits_all)
