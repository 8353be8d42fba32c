"""Lossless speculative sampling, end to end: with MTP drafts (often accepted on a 12-token
vocabulary) the engine's sampled tokens follow the target's exact distribution, computed here
with plain uncached forwards and compared by chi-square over thousands of seeded requests.
A verifier that accepts every draft, chosen through the config like any verifier, fails the
same comparison (the test has power)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from helpers.engine import AcceptAllVerifier, double, mtp, one_thread  # noqa: F401
from helpers.models import randomize_, tiny_config
from inkfw.models.inkling.model import InklingLM
from inkfw.speculative.factory import build_engine, serving_config
from inkfw.speculative.sampling import SamplingParams, processed_probs
from inkfw.speculative.verifier import TargetVerifier

V = 12  # logits vocabulary
PROMPT = [3, 7, 1, 9, 4]
MIN_P = 1e-3  # a seeded sample passes with probability 1 - MIN_P per comparison if the engine is exact


@pytest.fixture(scope="module")
def lm() -> InklingLM:
    """3 MTP depths; unembedding scaled so p is neither one-hot nor uniform (max ~0.3)."""
    cfg = tiny_config(vocab_size=16, unpadded_vocab_size=V, eos_token_id=None)
    torch.manual_seed(0)
    model = randomize_(InklingLM(cfg, mtp_depths=3), seed=0).eval()
    with torch.no_grad():
        model.unembed.weight.mul_(4.0)
    return model


@torch.no_grad()
def exact_marginals(model, params: SamplingParams, steps: int) -> list[np.ndarray]:
    """Marginal distribution of generated tokens 1..steps after PROMPT, by enumerating every
    prefix with uncached forwards: p(x1), sum p(x1) p(x2|x1), ..."""
    out = []
    prefixes, weights = [[]], torch.ones(1, dtype=torch.float64)
    for _ in range(steps):
        ids = torch.tensor([PROMPT + p for p in prefixes])
        probs = processed_probs(model.logits(model(ids)[:, -1]), params).double()  # [n, V]
        joint = weights[:, None] * probs  # [n, V]
        out.append(joint.sum(0).numpy())
        prefixes = [p + [x] for p in prefixes for x in range(V)]
        weights = joint.reshape(-1)
    return out


def chi2_pvalue(samples: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit; bins expected below 5 are merged into one. A sample of a token
    with probability 0 gives 0."""
    n = len(samples)
    counts = np.bincount(samples, minlength=V).astype(float)
    if counts[expected_probs <= 0].sum() > 0:
        return 0.0
    exp = expected_probs * n
    big, small = exp >= 5, (exp > 0) & (exp < 5)
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if small.any():
        obs_b.append(counts[small].sum())
        exp_b.append(exp[small].sum())
    exp_b = np.array(exp_b) * (n / sum(exp_b))  # exact float sum for scipy
    if len(obs_b) < 2:
        return 1.0
    return float(chisquare(obs_b, exp_b).pvalue)


def sample_tokens(
    model, drafter: Sequence[str], params: list[SamplingParams], max_new_tokens: int, verifier: Sequence[str] = ()
):
    """One engine from the serving factory (``drafter``, ``verifier``: config overrides), one
    request per params entry (each with its own seed); returns ([N, max_new_tokens] tokens, engine)."""
    N = len(params)
    cfg = serving_config(
        [
            "model=inkling-debug",
            *drafter,
            *verifier,
            "kv.block_size=4",
            f"kv.num_blocks={4 * N}",
            "kv.enable_prefix_caching=false",
            f"engine.max_num_seqs={N}",
            f"engine.max_num_batched_tokens={16 * N}",
            "engine.max_model_len=64",
        ]
    )
    eng, _ = build_engine(cfg, model=model)
    kv = eng.kv
    reqs = [eng.add_request(PROMPT, p, max_new_tokens=max_new_tokens) for p in params]
    eng.generate(reqs)
    assert kv.is_whole()
    assert all(r.num_preemptions == 0 and len(r.output_token_ids) == max_new_tokens for r in reqs)
    return np.array([r.output_token_ids for r in reqs]), eng


def test_exact_marginals_sum_to_one(lm):
    marg = exact_marginals(lm, SamplingParams(temperature=1.0), 3)
    for m in marg:
        assert abs(m.sum() - 1) < 1e-5
    assert 0.1 < marg[0].max() < 0.6  # neither one-hot nor uniform


@pytest.mark.parametrize("D,k", [(3, 3), (2, 4)])
def test_sampled_tokens_follow_target(lm, D, k):
    """Temperature 1: tokens 1, 2 and 3 (drafted by depths 0, 1 and 2, or by a decode step)
    are distributed as the target's own sampling, with most drafts accepted."""
    N = 2400
    params = SamplingParams(temperature=1.0)
    tokens, eng = sample_tokens(lm, mtp(D, k), [SamplingParams(temperature=1.0, seed=i) for i in range(N)], k + 1)
    assert type(eng.verifier) is TargetVerifier  # verifier=target, the default
    m = eng.metrics
    assert m.num_accepted_tokens > 0.3 * m.num_draft_tokens  # drafts matter: many tokens come from them
    assert m.accepted_per_position[2] > 0.05 * N  # third drafts accepted too
    for i, expected in enumerate(exact_marginals(lm, params, 3)):
        p = chi2_pvalue(tokens[:, i], expected)
        assert p > MIN_P, f"token {i + 1}: chi-square p-value {p:.2e}"


def test_top_k_top_p_first_tokens(lm):
    """top-k and top-p (with temperature) in one batch: the first tokens follow the processed
    target distributions, tokens outside the kept set never appear."""
    N = 1200
    variants = [SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0.7, top_p=0.8)]
    params = [dataclass_with_seed(variants[i % 2], i) for i in range(2 * N)]
    tokens, eng = sample_tokens(lm, mtp(3, 3), params, 3)
    assert eng.metrics.num_accepted_tokens > 0.3 * eng.metrics.num_draft_tokens
    for j, v in enumerate(variants):
        expected = exact_marginals(lm, v, 1)[0]
        assert (expected > 0).sum() < V  # the filter really removes tokens
        p = chi2_pvalue(tokens[j::2, 0], expected)
        assert p > MIN_P, f"{v}: chi-square p-value {p:.2e}"


def dataclass_with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=seed)


def test_always_accepting_verifier_is_detected(lm):
    """Negative control: a lossy verifier that accepts every draft (then samples the bonus from
    p), selected with a ``verifier`` override, emits the drafter's distribution, and the same
    comparison rejects it outright."""
    N = 1500
    tokens, eng = sample_tokens(
        lm,
        mtp(2, 2),
        [SamplingParams(temperature=1.0, seed=i) for i in range(N)],
        3,
        verifier=double("verifier", AcceptAllVerifier),
    )
    assert type(eng.verifier) is AcceptAllVerifier
    assert eng.metrics.num_accepted_tokens == eng.metrics.num_draft_tokens
    exact = exact_marginals(lm, SamplingParams(temperature=1.0), 2)
    assert chi2_pvalue(tokens[:, 0], exact[0]) < 1e-6
    assert chi2_pvalue(tokens[:, 1], exact[1]) < 1e-6
