"""The one-screen reference loop (inkfw/speculative/loop.py) is the engine's algorithm: for every
request the batched engine emits exactly what ``speculative_generate`` emits alone, greedy and
sampled with the same seeds, for k <= D, k > D and no drafts at all."""

from __future__ import annotations

import random

import pytest
import torch

from helpers.engine import NO_DRAFTER, generate, mtp, one_thread, outputs, random_prompts, spec_model, uncached_greedy  # noqa: F401
from inkfw.speculative.loop import speculative_generate
from inkfw.speculative.sampling import SamplingParams

CASES = [(0, 0), (1, 1), (2, 2), (3, 1), (3, 5), (4, 4), (4, 7)]  # (D, k); D = 0: no drafts


@pytest.fixture(scope="module")
def model():
    return spec_model(seed=0)


@pytest.fixture(scope="module")
def small_vocab_model():
    """12 logits: sampled MTP drafts are often accepted, so every acceptance path runs."""
    m = spec_model(seed=1, vocab_size=16, unpadded_vocab_size=12, eos_token_id=None)
    with torch.no_grad():
        m.unembed.weight.mul_(4.0)
    return m


def drafter(D: int, k: int) -> list[str]:
    return mtp(D, k) if D else NO_DRAFTER


@pytest.mark.parametrize("D,k", CASES)
def test_greedy_engine_equals_the_loop(model, D, k):
    rng = random.Random(10 * D + k)
    prompts = [[rng.randrange(120)]] + random_prompts(rng, 4, 120, lo=2, hi=30)
    reqs, eng, _ = generate(model, drafter(D, k), prompts, 12, check_drafts=False, max_num_batched_tokens=16)
    loop = [speculative_generate(model, p, k, D, max_new_tokens=12) for p in prompts]
    assert outputs(reqs) == loop
    assert loop == [uncached_greedy(model, p, 12) for p in prompts]
    if D:
        assert eng.metrics.num_draft_tokens > 0


@pytest.mark.parametrize("D,k", CASES)
def test_sampled_engine_equals_the_loop_with_the_same_seeds(small_vocab_model, D, k):
    m = small_vocab_model
    rng = random.Random(D + 7 * k)
    prompts = [[rng.randrange(12)]] + random_prompts(rng, 5, 12, lo=2, hi=20)
    params = [
        SamplingParams(temperature=1.0, seed=100 + i, top_k=[None, 6][i % 2], top_p=[1.0, 0.9][i % 3 == 0])
        for i in range(len(prompts))
    ]
    reqs, eng, _ = generate(m, drafter(D, k), prompts, 12, params=params, check_drafts=False)
    loop = [speculative_generate(m, p, k, D, sp, max_new_tokens=12) for p, sp in zip(prompts, params)]
    assert outputs(reqs) == loop
    if D:  # drafts were accepted and rejected, so both acceptance branches consumed draws
        assert 0 < eng.metrics.num_accepted_tokens < eng.metrics.num_draft_tokens
    reseeded = [
        SamplingParams(temperature=1.0, seed=900 + i, top_k=sp.top_k, top_p=sp.top_p) for i, sp in enumerate(params)
    ]
    assert [speculative_generate(m, p, k, D, sp, max_new_tokens=12) for p, sp in zip(prompts, reseeded)] != loop
