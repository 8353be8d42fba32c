"""Acceptance metrics: hand-built steps, the identities between them, and the chain formulas."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inkfw.speculative.metrics import SpecMetrics, expected_tokens_per_step, simulated_acceptance_length

# (num_drafts, num_accepted) per request-step
STEP = st.integers(0, 8).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d)))


def hand_built() -> SpecMetrics:
    m = SpecMetrics()
    m.record([3, 3, 3, 0], [3, 1, 0, 0])  # one engine step, four requests
    m.record(torch.tensor([2]), torch.tensor([2]))
    return m


def test_hand_built_counts():
    m = hand_built()
    assert (m.num_steps, m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (5, 4, 11, 6)
    assert m.num_emitted_tokens == 11
    assert m.mean_acceptance_length == pytest.approx(11 / 5)
    assert m.draft_acceptance_rate == pytest.approx(6 / 11)
    assert m.accepted_per_position == [3, 2, 1]
    assert m.drafted_per_position == [4, 4, 3]
    assert m.per_position_acceptance == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert m.reached_per_position == [4, 3, 1]  # (3, 3) reached draft 3; (2, 2) drafted none there
    assert m.conditional_acceptance == pytest.approx([3 / 4, 2 / 3, 1 / 1])
    assert m.mean_acceptance_length == pytest.approx(1 + sum(m.per_position_acceptance))


def test_positions_drafted_but_never_accepted_report_zero():
    m = SpecMetrics()
    m.record(4, 1)
    assert m.per_position_acceptance == [1.0, 0.0, 0.0, 0.0]
    assert m.conditional_acceptance == [1.0, 0.0, 0.0, 0.0]


def test_conditional_acceptance_under_changing_k():
    """Adaptive k: many k = 3 steps that accept all three drafts must not make draft 4 look
    rejected: the 25 k = 8 steps that reached draft 4 accepted it 20 times."""
    m = SpecMetrics()
    for _ in range(25):  # k = 3: a = 3, 3, 3, 3, 0
        m.record([3] * 5, [3, 3, 3, 3, 0])
    for _ in range(5):  # k = 8 probes: a = 8, 8, 8, 8, 3
        m.record([8] * 5, [8, 8, 8, 8, 3])
    assert m.reached_per_position == [150, 125, 125, 25, 20, 20, 20, 20]
    assert m.conditional_acceptance == pytest.approx([125 / 150, 1.0, 1.0, 20 / 25, 1.0, 1.0, 1.0, 1.0])
    assert m.accepted_per_position[3] / m.accepted_per_position[2] < 0.2  # the old ratio: deflated
    plain = SpecMetrics()
    plain.record([0, 0], [0, 0])  # plain steps reach no draft
    assert plain.conditional_acceptance == [] and plain.reached_per_position == []


def test_empty_metrics_are_zero_and_serialisable():
    d = SpecMetrics().to_dict()
    assert d["mean_acceptance_length"] == 0.0 and d["per_position_acceptance"] == []
    json.dumps(d)


def test_to_dict():
    d = hand_built().to_dict()
    json.dumps(d)
    assert d["mean_acceptance_length"] == pytest.approx(2.2)
    assert d["per_position_acceptance"] == pytest.approx([0.6, 0.4, 0.2])
    assert {
        "num_steps",
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "num_emitted_tokens",
        "draft_acceptance_rate",
        "conditional_acceptance",
    } <= d.keys()


def test_record_rejects_inconsistent_counts():
    with pytest.raises(ValueError, match="num_accepted"):
        SpecMetrics().record([2], [3])
    with pytest.raises(ValueError):
        SpecMetrics().record([2, 2], [1])


def test_merge_equals_recording_everything():
    a, b, both = SpecMetrics(), SpecMetrics(), SpecMetrics()
    a.record([1, 2], [1, 0])
    b.record([5, 3], [4, 3])
    both.record([1, 2, 5, 3], [1, 0, 4, 3])
    a.merge(b)
    assert a == both


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.8, 0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)


def test_simulated_acceptance_length():
    assert simulated_acceptance_length([]) == 1.0
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    # the published MTP-8 per-position rates (unconditional) imply tau 4.50
    published = [0.762, 0.616, 0.513, 0.424, 0.364, 0.309, 0.272, 0.237]
    conditional = [published[0]] + [b / a for a, b in zip(published, published[1:])]
    assert simulated_acceptance_length(conditional) == pytest.approx(4.50, abs=0.01)


def test_constant_acceptance_chain_matches_formula():
    """Monte Carlo: drafts each accepted with probability alpha; tau -> (1 - a^(k+1)) / (1 - a)."""
    alpha, k, n = 0.7, 4, 20_000
    ok = torch.rand(n, k, generator=torch.Generator().manual_seed(0)) < alpha
    accepted = ok.long().cumprod(-1).sum(-1)
    m = SpecMetrics()
    m.record(torch.full((n,), k), accepted)
    assert m.mean_acceptance_length == pytest.approx(expected_tokens_per_step(alpha, k), abs=0.03)
    assert m.conditional_acceptance == pytest.approx([alpha] * k, abs=0.02)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(STEP, min_size=1, max_size=6), min_size=1, max_size=8))
def test_identities(engine_steps):
    m = SpecMetrics()
    for step in engine_steps:
        m.record([d for d, _ in step], [a for _, a in step])
    per_pos, cond = m.per_position_acceptance, m.conditional_acceptance
    assert m.mean_acceptance_length == pytest.approx(1 + sum(per_pos))
    reached = m.reached_per_position
    assert all(a <= r for a, r in zip(m.accepted_per_position, reached))
    assert all(r <= a for r, a in zip(reached[1:], m.accepted_per_position))  # reaching i + 1 took accepting i
    if len({d for s in engine_steps for d, _ in s}) == 1:  # one k throughout: the chain identities hold
        assert simulated_acceptance_length(cond) == pytest.approx(m.mean_acceptance_length)
        for i, rate in enumerate(per_pos):  # the conditional rates telescope to the unconditional ones
            assert math.prod(cond[: i + 1]) == pytest.approx(rate)
    assert len(per_pos) == len(reached) == len(m.drafted_per_position) == max(d for s in engine_steps for d, _ in s)
    assert all(a <= d for a, d in zip(m.accepted_per_position, m.drafted_per_position))
