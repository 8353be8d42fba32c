"""The algorithm on one screen: speculative decoding of one request with multi-depth MTP drafts.

The engine (``engine.py``) runs the same rounds for many requests at once, with a paged cache,
chunked prefill and MTP caches it re-prefills (docs/design.md §2, §5); this loop keeps the
target in a dense cache and simply recomputes the drafts' MTP steps from the committed tokens
each round. Same acceptance functions, same sampler, same random numbers in the same order, so
``tests/test_loop.py`` checks that the engine's output equals this function's, greedy and sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from inkfw.cache.dense import DenseModelCache
from inkfw.speculative.acceptance import greedy_accept, rejection_sample
from inkfw.speculative.interfaces import TargetModel, TokenSampler
from inkfw.speculative.sampling import Sampler, SamplingParams


@torch.no_grad()
def speculative_generate(
    model: TargetModel,
    prompt_ids: Sequence[int],
    num_tokens: int,
    depths: int,
    sampling: SamplingParams | None = None,
    max_new_tokens: int = 32,
    sampler: TokenSampler | None = None,
) -> list[int]:
    """New tokens after ``prompt_ids``: k = ``num_tokens`` drafts per verify step from D = ``depths``."""
    sampling, device = sampling or SamplingParams(), next(model.parameters()).device
    sampler = sampler or Sampler(device)
    gen = None if sampling.greedy else sampler.generator(sampling)
    k, D = (num_tokens, depths) if depths > 0 else (0, 0)
    P, max_len, eos = min(D, k), model.cfg.max_position_embeddings, set(model.cfg.eos_token_ids)
    x, out = list(prompt_ids), []
    target = DenseModelCache(model, 1, len(x) + max_new_tokens + k).layers

    def tensor(values):
        return torch.tensor([values], dtype=torch.long, device=device)  # [1, T]

    def draft(logits) -> None:  # logits [V]: the argmax, or a sample from the processed q (kept for acceptance)
        q = None if sampling.greedy else sampler.probs(logits[None], [sampling])  # [1, V]
        drafts.append(int(logits.argmax()) if q is None else int(sampler.sample(q, [gen])))
        if q is not None:
            qs.append(q[0])

    # prefill: final target states [1, L-1, H] of positions 0 .. L-2 (x[L-1] is fed by the first verify step)
    hidden = (
        model(tensor(x[:-1]), tensor(list(range(len(x) - 1))), target)
        if len(x) > 1
        else torch.zeros(1, 0, model.cfg.hidden_size, dtype=next(model.parameters()).dtype, device=device)
    )
    while True:
        L = len(x)
        n = max(0, min(k, max_new_tokens - len(out) - 1, max_len - L)) if L > 1 else 0  # drafts need a final state
        drafts: list[int] = []
        qs: list[torch.Tensor] = []  # q of each sampled draft
        if n:  # draft (§2): prefill steps s < P over positions 0 .. L-2, then depth s % D on one new position
            mtp = DenseModelCache(model, 1, L + k).mtp
            g, positions = hidden, tensor(list(range(L - 1)))
            for s in range(min(P, n)):
                g = model.mtp_step(s, g, tensor((x + drafts)[s + 1 : s + L]), positions, mtp[s])  # x[t+s+1]
                draft(model.logits(g[0, -1]))
            for s in range(P, n):  # k > D: decode steps; depth s % D sees its prefill state and its own writes
                g = model.mtp_step(s % D, g[:, -1:], tensor([drafts[-1]]), tensor([L - 2 + s - P + 1]), mtp[s % D])
                draft(model.logits(g[0, -1]))
        # verify (§3): the target over [x[L-1], d_1 .. d_n] at positions L-1 .. L-1+n, then accept
        h = model(tensor([x[-1], *drafts]), tensor(list(range(L - 1, L + n))), target)  # [1, 1+n, H]
        logits, d_t = model.logits(h), tensor(drafts)  # [1, 1+n, V], [1, n]
        if sampling.greedy:
            a, t = greedy_accept(d_t, logits)
        else:
            p = sampler.probs(logits, [sampling])  # [1, 1+n, V]
            uniforms, noise = sampler.acceptance_draws([gen], torch.tensor([n]), n, p.shape[-1], device)
            a, t = rejection_sample(d_t, torch.stack(qs)[None] if qs else None, p, uniforms, noise)  # q [1, n, V]
        a = int(a)
        hidden = torch.cat([hidden, h[:, : a + 1]], dim=1)  # [1, L + a, H]: x[L-1] and the accepted drafts are final
        for token in drafts[:a] + [int(t)]:  # commit a drafts and the bonus/replacement token
            x.append(token)
            out.append(token)
            if token in eos or len(out) >= max_new_tokens or len(x) >= max_len:
                return out
