"""The target verifier: one forward over ``[x[L-1], d_1 .. d_k]`` per request, then acceptance.

Greedy batches use :func:`~inkfw.speculative.acceptance.greedy_accept`; as soon as one request samples,
the whole batch goes through lossless rejection sampling on processed probabilities (greedy
rows get one-hot targets, so they still accept exactly the argmax prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inkfw.speculative.interfaces import Drafts, KVManager, RequestLike, Verdict
from inkfw.speculative.sampling import processed_probs
from inkfw.speculative.acceptance import greedy_accept, rejection_sample


class TargetVerifier:
    def __init__(self, clock=None):
        self.clock = clock

    def _run(self, fn, *args):
        return self.clock(fn, *args) if self.clock is not None else fn(*args)

    @torch.no_grad()
    def verify(self, model, kv: KVManager, requests: Sequence[RequestLike], drafts: Drafts) -> Verdict:
        device = drafts.tokens.device
        B, k = drafts.tokens.shape
        last = torch.tensor([r.token_ids[-1] for r in requests], device=device)
        start = torch.tensor([len(r.token_ids) - 1 for r in requests], device=device)
        ids = torch.cat([last[:, None], drafts.tokens], dim=1)  # [B, 1+k]
        slots = torch.arange(k + 1, device=device)
        positions = start[:, None] + slots  # [B, 1+k]
        valid = slots[None, :] <= drafts.num_drafts[:, None]  # [B, 1+k]
        caches = kv.target_caches([r.id for r in requests], positions, valid)
        hidden = self._run(model, ids, positions, caches)  # [B, 1+k, H]
        logits = self._run(model.logits, hidden)  # [B, 1+k, V]

        params = [r.sampling for r in requests]
        if all(p.greedy for p in params):
            num_accepted, next_tokens = greedy_accept(drafts.tokens, logits, drafts.num_drafts)
        else:
            p = processed_probs(logits, params)  # [B, 1+k, V]
            num_accepted, next_tokens = rejection_sample(drafts.tokens, drafts.probs, p, drafts.num_drafts,
                                                         [r.generator for r in requests])
        return Verdict(num_accepted, next_tokens, hidden)
