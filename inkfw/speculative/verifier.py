"""The target verifier: one forward over ``[x[L-1], d_1 .. d_k]`` per request, then acceptance
(docs/design.md §3).

Greedy batches use :func:`~inkfw.speculative.acceptance.greedy_accept`; as soon as one request
samples, the whole batch goes through lossless rejection sampling on the sampler's processed
probabilities, with the sampler's draws from each request's generator (greedy rows get one-hot
targets, so they still accept exactly the argmax prefix).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

from inkfw.kernels import Kernels
from inkfw.speculative.interfaces import (
    Drafts,
    ForwardRunner,
    KVManager,
    RequestLike,
    TargetModel,
    TokenSampler,
    Verdict,
)
from inkfw.speculative.observers import run_directly
from inkfw.speculative.sampling import Sampler
from inkfw.speculative.step import (
    StepBuffers,
    StepFunction,
    StepModes,
    flat_tables,
    prefill_width,
    table_views,
    table_width,
)


class TargetVerifier(StepModes):
    """``inkfw/conf/verifier/target.yaml``: the target model decides, losslessly.

    The forward and greedy acceptance are one function of tensors (:meth:`forward`) over
    persistent input buffers, compiled or graph-captured by the engine's choice
    (:meth:`set_step_mode`); it reads nothing back to the host."""

    def __init__(self, model: TargetModel, sampler: TokenSampler | None = None, kernels: Kernels | None = None):
        self.model = model
        self.sampler = sampler or Sampler()
        self.device = next(model.parameters()).device
        self.buffers = StepBuffers(self.device)
        # acceptance rules: the torch references (speculative/acceptance.py) or their Triton kernels
        self.kernels = kernels or Kernels("torch")

    @torch.no_grad()
    def verify(
        self,
        kv: KVManager,
        requests: Sequence[RequestLike],
        drafts: Drafts,
        run: ForwardRunner = run_directly,
        pad_to: int | None = None,
    ) -> Verdict:
        """The target over ``[x[L-1], d_1 .. d_k]`` of each request, in a batch padded to
        ``pad_to`` rows (static shapes; padding rows write only scratch slots)."""
        B, k = drafts.tokens.shape
        pad = max(0, (pad_to or B) - B)
        counts = drafts.host_counts()
        starts = [len(r.token_ids) - 1 for r in requests] + [0] * pad
        num_drafts = list(counts) + [-1] * pad  # -1: a padding row, nothing valid
        stage = self.buffers.stage
        tables = kv.step_tables(
            kv.group_indices(),
            [r.id for r in requests] + [None] * pad,
            starts,
            [s + n + 1 for s, n in zip(starts, num_drafts)],
            width=table_width if pad_to is not None else (lambda n: n),
            stage=stage,
        )
        # positions and validity come from the host too: computing positions inside a compiled
        # graph that also writes the cache's slot tags miscompiled on CPU (torch 2.13 inductor)
        if k:
            staged_drafts = stage("drafts", F.pad(drafts.tokens, (0, 0, 0, pad)) if pad else drafts.tokens)
        else:  # nothing drafted: empty rows, nothing to copy
            staged_drafts = stage("drafts", [[]] * (B + pad))
        args = [
            stage("last", [r.token_ids[-1] for r in requests] + [0] * pad),
            staged_drafts,
            stage("num_drafts", num_drafts),
            stage("positions", [[s + i for i in range(k + 1)] for s in starts]),
            stage("valid", [[i <= n for i in range(k + 1)] for n in num_drafts]),  # 0 / 1: one dtype, one copy
        ]
        args += flat_tables(tables)
        self.buffers.flush()  # the staged host values (all integers): one copy
        hidden, logits, num_accepted, next_tokens = run(self._function(kv, len(tables)), *args)
        if not all(r.sampling.greedy for r in requests) or type(self).accept is not TargetVerifier.accept:
            num_accepted, next_tokens = self.accept(logits[:B], requests, drafts)  # sampled (or a subclass's rule)
        if pad:  # the real rows (a slice is an op: one beside the graphs, each, on a GPU)
            num_accepted, next_tokens, hidden = num_accepted[:B], next_tokens[:B], hidden[:B]
        return Verdict(num_accepted, next_tokens, hidden)

    @torch.no_grad()
    def prefill(
        self,
        kv: KVManager,
        chunks: Sequence[tuple[Hashable, Sequence[int], int]],
        run: ForwardRunner = run_directly,
        pad_to: int | None = None,
    ) -> list[torch.Tensor]:
        """The target over prompt chunks ``(request id, tokens, first position)``: each chunk's
        hidden states [len(tokens), H], which the chunk's drafting round reads next. With
        ``pad_to`` (CUDA graphs) the batch is padded to ``pad_to`` rows and to the chunks' width
        bucket (:func:`prefill_width`) and runs as a step function: one captured graph per shape,
        where an eager prompt pass costs a launch per op (docs/design.md §5). Padding positions
        write only scratch slots."""
        B, T = len(chunks), max(len(tokens) for _, tokens, _ in chunks)
        static = pad_to is not None
        W = prefill_width(T) if static else T
        padded = [*chunks, *[(None, (), 0)] * (max(B, pad_to or 0) - B)]  # padding rows: no tokens
        rids = [rid for rid, _, _ in padded]
        first = [c0 for _, _, c0 in padded]
        lengths = [len(tokens) for _, tokens, _ in padded]
        end = [c0 + n for c0, n in zip(first, lengths)]
        ids = [list(tokens) + [0] * (W - len(tokens)) for _, tokens, _ in padded]
        # padding positions repeat the chunk's last one (invalid: written to the scratch slot)
        positions = [[c0 + min(i, max(0, n - 1)) for i in range(W)] for c0, n in zip(first, lengths)]
        valid = [[i < n for i in range(W)] for n in lengths]
        if not static:
            tables = kv.step_tables(kv.group_indices(), rids, first, end)
            pos = torch.tensor(positions, device=self.device)
            hidden = run(
                self.model,
                torch.tensor(ids, device=self.device),
                pos,
                kv.caches_from(tables, pos, torch.tensor(valid, device=self.device)),
            )
        else:
            stage = self.buffers.stage
            tables = kv.step_tables(kv.group_indices(), rids, first, end, width=table_width, stage=stage)
            args = [
                stage("prefill_ids", ids),
                stage("prefill_positions", positions),
                stage("prefill_valid", valid),  # 0 / 1
            ]
            args += flat_tables(tables)
            self.buffers.flush()
            hidden = run(self._prefill_function(kv, len(tables)), *args)
        return [hidden[b, :n] for b, n in enumerate(lengths[:B])]  # [rows, W, H] -> [n, H] each

    def _prefill_function(self, kv: KVManager, num_groups: int) -> StepFunction:
        def prefill_step(ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, *tables: torch.Tensor):
            views = table_views(kv.group_indices(), tables)
            return self.model(ids, positions, kv.caches_from(views, positions, valid.bool()))  # [B, W, H]

        return self._step_function(("prefill", num_groups), prefill_step, "prefill", tables_from=3)

    def _function(self, kv: KVManager, num_groups: int) -> StepFunction:
        def verify_step(*args: torch.Tensor):
            return self.forward(kv, *args)

        return self._step_function(num_groups, verify_step, "verify", tables_from=5)

    def forward(
        self,
        kv: KVManager,
        last: torch.Tensor,
        draft_tokens: torch.Tensor,
        num_drafts: torch.Tensor,
        positions: torch.Tensor,
        valid: torch.Tensor,
        *tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """last [B], draft_tokens [B, k], num_drafts [B] (-1: padding), positions [B, 1+k] (L - 1 ..),
        valid [B, 1+k] (bool, or 0 / 1 as staged), block tables -> (hidden [B, 1+k, H], logits [B, 1+k, V],
        greedy num_accepted [B], greedy next token [B])."""
        ids = torch.cat([last[:, None], draft_tokens], dim=1)  # [B, 1+k]
        views = table_views(kv.group_indices(), tables)
        hidden = self.model(ids, positions, kv.caches_from(views, positions, valid.bool()))  # [B, 1+k, H]
        logits = self.model.logits(hidden)  # [B, 1+k, V]
        num_accepted, next_tokens = self.kernels.greedy_accept(
            draft_tokens, logits, num_drafts.clamp(min=0), check=False
        )
        return hidden, logits, num_accepted, next_tokens

    def sample(
        self, logits: torch.Tensor, requests: Sequence[RequestLike], drafts: Drafts, counts: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless rejection sampling of a batch with sampled requests (eager: the draws come
        from each request's generator, docs/design.md §3)."""
        params = [r.sampling for r in requests]
        k = drafts.tokens.shape[1]
        p = self.sampler.probs(logits, params)  # [B, 1+k, V]
        uniforms, noise = self.sampler.acceptance_draws(
            [r.generator for r in requests], list(counts), k, p.shape[-1], p.device
        )  # [B, k], [B, V]
        return self.kernels.rejection_sample(
            drafts.tokens, drafts.probs, p, uniforms, noise, drafts.num_drafts, check=False
        )

    def accept(
        self, logits: torch.Tensor, requests: Sequence[RequestLike], drafts: Drafts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num_accepted [B], next_tokens [B])`` from the target's ``logits`` [B, 1+k, V].
        :meth:`verify` calls it for batches with sampled requests (greedy batches take the
        acceptance computed inside the step function), or always when a subclass overrides it."""
        if all(r.sampling.greedy for r in requests):
            return self.kernels.greedy_accept(drafts.tokens, logits, drafts.num_drafts, check=False)
        counts = drafts.host_counts()
        return self.sample(logits, requests, drafts, counts)
