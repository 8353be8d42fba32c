"""Sampling parameters, processed probabilities (temperature, top-k, top-p) and seeded sampling."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from inkfw.errors import ConfigError
from inkfw.speculative.sampling import Sampler, SamplingParams, processed_probs, sample

GREEDY = SamplingParams()
PLAIN = SamplingParams(temperature=1.0)
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None]  # [1, 4]


# --------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=math.nan), "temperature"),
        (dict(temperature=math.inf), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(seed=2**64), "seed"),
    ],
)
def test_invalid_params_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field) as info:
        SamplingParams(**bad)
    msg = str(info.value)
    assert msg.count(".") >= 1 and "\n" not in msg  # one sentence


def test_valid_params():
    for ok in (
        dict(),
        dict(temperature=0.7, top_k=0, top_p=1.0, seed=0),
        dict(top_k=None, top_p=1e-3),
        dict(temperature=2, top_k=50, seed=2**64 - 1),
    ):
        SamplingParams(**ok).validate()
    assert SamplingParams().greedy and not SamplingParams(temperature=0.1).greedy


# --------------------------------------------------------------------------- processed_probs
def test_temperature_scales_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    for t in (0.5, 1.0, 3.0):
        got = processed_probs(logits, SamplingParams(temperature=t))
        assert torch.allclose(got, torch.softmax(logits / t, -1))


def test_greedy_is_one_hot_argmax_and_ignores_filters():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0]])  # tie: the first argmax wins
    for params in (GREEDY, SamplingParams(top_k=3, top_p=0.2)):
        assert processed_probs(logits, params).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_top_k():
    got = processed_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(got, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    for off in (0, None, 4, 100):
        assert torch.allclose(processed_probs(LOGITS, SamplingParams(temperature=1.0, top_k=off)), PROBS[None])


def test_top_k_keeps_ties():
    got = processed_probs(torch.tensor([[3.0, 2.0, 2.0, 1.0]]), SamplingParams(temperature=1.0, top_k=2))
    assert (got > 0).tolist() == [[True, True, True, False]]


@pytest.mark.parametrize("top_p, kept", [(1.0, 4), (0.97, 4), (0.9, 3), (0.75, 2), (0.45, 1), (1e-6, 1)])
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    got = processed_probs(LOGITS, SamplingParams(temperature=1.0, top_p=top_p))[0]
    expected = torch.zeros(4)
    expected[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    assert torch.allclose(got, expected)


def test_top_p_keeps_ties():
    got = processed_probs(torch.tensor([0.4, 0.3, 0.3]).log()[None], SamplingParams(temperature=1.0, top_p=0.5))
    assert (got > 0).tolist() == [[True, True, True]]


def test_top_k_applies_before_top_p():
    # after top-k 2 the mass is [0.625, 0.375]: top_p 0.6 keeps one token (alone it would keep two)
    both = processed_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2, top_p=0.6))
    assert torch.allclose(both, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    assert (processed_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.6)) > 0).sum() == 2


def test_temperature_applies_before_top_p():
    # at temperature 2 the distribution flattens, so top_p 0.75 needs three tokens
    got = processed_probs(LOGITS, SamplingParams(temperature=2.0, top_p=0.75))[0]
    flat = torch.softmax(LOGITS[0] / 2, -1)
    assert flat[:2].sum() < 0.75 <= flat[:3].sum()
    assert torch.allclose(got, torch.cat([flat[:3] / flat[:3].sum(), torch.zeros(1)]))


def test_mixed_batch_equals_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 50, generator=g)  # [N, T, V]: params per row, shared over T
    params = [
        GREEDY,
        PLAIN,
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=10, top_p=0.5),
    ]
    batch = processed_probs(logits, params)
    assert batch.shape == logits.shape and batch.dtype == torch.float32
    for i, p in enumerate(params):
        assert torch.allclose(batch[i], processed_probs(logits[i], [p] * 3), atol=1e-7)
    assert torch.allclose(batch.sum(-1), torch.ones(5, 3))


def test_processed_probs_checks_row_count():
    with pytest.raises(ValueError, match="SamplingParams"):
        processed_probs(torch.zeros(3, 4), [PLAIN, PLAIN])


# --------------------------------------------------------------------------- sampling
def test_sample_follows_probs():
    n, p = 20_000, torch.tensor([0.3, 0.0, 0.25, 0.15, 0.3, 0.0])
    tokens = sample(p[None].expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[1] == counts[5] == 0  # zero-probability tokens never come out
    keep = p > 0
    expected = p[keep].double() / p[keep].double().sum() * n
    assert chisquare(counts[keep].numpy(), expected.numpy()).pvalue > 1e-3


def test_sampler_greedy_rows_take_argmax_and_consume_no_randomness():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    sampler = Sampler()
    gens = [sampler.generator(SamplingParams(seed=s)) for s in (1, 2, 3)]
    before = [g.get_state() for g in gens]
    tokens = sampler(logits, [GREEDY, SamplingParams(temperature=1.0, seed=2), GREEDY], gens)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    assert torch.equal(gens[0].get_state(), before[0]) and torch.equal(gens[2].get_state(), before[2])
    assert not torch.equal(gens[1].get_state(), before[1])


def test_seeded_request_ignores_batch_composition():
    """Seed 1234 yields the same tokens alone, in a batch, at another row, with other params."""
    sampler = Sampler()
    mine = SamplingParams(temperature=1.0, top_k=30, top_p=0.9, seed=1234)
    others = [SamplingParams(temperature=0.8, seed=7), GREEDY, SamplingParams(temperature=1.5, top_p=0.5)]
    steps = [torch.randn(4, 64, generator=torch.Generator().manual_seed(s)) for s in range(6)]  # [4, V] per step

    g = sampler.generator(mine)
    alone = [int(sampler(s[:1], [mine], [g])[0]) for s in steps]
    for row in range(4):
        batch = others[:row] + [mine] + others[row:]
        steps_at_row = [torch.cat([s[1 : row + 1], s[:1], s[row + 1 :]]) for s in steps]  # my logits at `row`
        gens = [sampler.generator(p) for p in batch]
        got = [int(sampler(s, batch, gens)[row]) for s in steps_at_row]
        assert got == alone
    assert len(set(alone)) > 1  # it really sampled


def test_unseeded_generators_follow_torch_manual_seed():
    sampler = Sampler()
    logits = torch.randn(1, 100)
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        g = sampler.generator(PLAIN)
        runs.append([int(sampler(logits, [PLAIN], [g])[0]) for _ in range(5)])
    assert runs[0] == runs[1]


def test_sampler_probs_and_sample_delegate():
    sampler = Sampler()
    logits = torch.randn(2, 8)
    assert torch.equal(sampler.probs(logits, PLAIN), processed_probs(logits, PLAIN))
    a = sampler.sample(sampler.probs(logits, PLAIN), torch.Generator().manual_seed(3))
    b = sample(processed_probs(logits, PLAIN), torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_acceptance_draws_per_row_generators():
    """Row b draws its num_drafts[b] uniforms, then V exponentials, from its own generator only
    (the rest of its uniform row is 1.0), so a seeded request's verify steps do not depend on
    the batch; the noise is never 0."""
    seeds, counts, k, V = [5, 6, 7], [2, 0, 3], 3, 4
    uniforms, noise = Sampler().acceptance_draws(
        [torch.Generator().manual_seed(s) for s in seeds], torch.tensor(counts), k, V, "cpu"
    )
    assert uniforms.shape == (3, k) and uniforms.dtype == torch.float64 and noise.shape == (3, V)
    for b, (seed, n) in enumerate(zip(seeds, counts)):
        g = torch.Generator().manual_seed(seed)
        assert torch.equal(uniforms[b, :n], torch.rand(n, generator=g, dtype=torch.float64))
        assert (uniforms[b, n:] == 1.0).all()
        assert torch.equal(noise[b], torch.empty(1, V).exponential_(generator=g)[0].clamp_min(torch.finfo().tiny))
    assert (noise > 0).all()


def test_acceptance_draws_shared_generator_draws_whole_blocks():
    """One generator for the batch: the whole [B, k] uniform block first, then the [B, V] noise."""
    uniforms, noise = Sampler().acceptance_draws(torch.Generator().manual_seed(9), torch.tensor([1, 2]), 2, 5, "cpu")
    g = torch.Generator().manual_seed(9)
    assert torch.equal(uniforms, torch.rand(2, 2, generator=g, dtype=torch.float64))
    assert torch.equal(noise, torch.empty(2, 5).exponential_(generator=g).clamp_min(torch.finfo().tiny))
