"""The target verifier: one forward over ``[x[L-1], d_1 .. d_k]`` per request, then acceptance
(docs/design.md §3).

Greedy batches use :func:`~inkfw.speculative.acceptance.greedy_accept`; as soon as one request
samples, the whole batch goes through lossless rejection sampling on the sampler's processed
probabilities, with the sampler's draws from each request's generator (greedy rows get one-hot
targets, so they still accept exactly the argmax prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inkfw.speculative.acceptance import greedy_accept, rejection_sample
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


class TargetVerifier:
    """``inkfw/conf/verifier/target.yaml``: the target model decides, losslessly."""

    def __init__(self, model: TargetModel, sampler: TokenSampler | None = None):
        self.model = model
        self.sampler = sampler or Sampler()

    @torch.no_grad()
    def verify(
        self, kv: KVManager, requests: Sequence[RequestLike], drafts: Drafts, run: ForwardRunner = run_directly
    ) -> Verdict:
        device = drafts.tokens.device
        B, k = drafts.tokens.shape
        last = torch.tensor([r.token_ids[-1] for r in requests], device=device)
        start = torch.tensor([len(r.token_ids) - 1 for r in requests], device=device)
        ids = torch.cat([last[:, None], drafts.tokens], dim=1)  # [B, 1+k]
        slots = torch.arange(k + 1, device=device)
        positions = start[:, None] + slots  # [B, 1+k]
        valid = slots[None, :] <= drafts.num_drafts[:, None]  # [B, 1+k]
        caches = kv.target_caches([r.id for r in requests], positions, valid)
        hidden = run(self.model, ids, positions, caches)  # [B, 1+k, H]
        logits = run(self.model.logits, hidden)  # [B, 1+k, V]
        num_accepted, next_tokens = self.accept(logits, requests, drafts)
        return Verdict(num_accepted, next_tokens, hidden)

    def accept(
        self, logits: torch.Tensor, requests: Sequence[RequestLike], drafts: Drafts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num_accepted [B], next_tokens [B])`` from the target's ``logits`` [B, 1+k, V]."""
        params = [r.sampling for r in requests]
        if all(p.greedy for p in params):
            return greedy_accept(drafts.tokens, logits, drafts.num_drafts)
        B, k = drafts.tokens.shape
        p = self.sampler.probs(logits, params)  # [B, 1+k, V]
        uniforms, noise = self.sampler.acceptance_draws(
            [r.generator for r in requests], drafts.num_drafts, k, p.shape[-1], p.device
        )  # [B, k], [B, V]
        return rejection_sample(drafts.tokens, drafts.probs, p, uniforms, noise, drafts.num_drafts)
