"""Adaptive k (inkfw.speculative.adaptive.AdaptiveK): acceptance estimates, choice, probing."""

from __future__ import annotations

import json
import math
import random

import pytest

from inkfw.errors import ConfigError
from inkfw.speculative.adaptive import AdaptiveK, fit_step_costs, non_decreasing


def draw_steps(rng: random.Random, rates: list[float], k: int, batch: int) -> tuple[list[int], list[int]]:
    """One verify step of ``batch`` requests drafting k tokens, draft i accepted with conditional
    probability ``rates[i-1]`` given its predecessors."""
    accepted = []
    for _ in range(batch):
        a = 0
        while a < k and rng.random() < rates[a]:
            a += 1
        accepted.append(a)
    return [k] * batch, accepted


def brute_force_best(rates: list[float], step_s: list[float]) -> int:
    """Best k from the true rates, by enumerating every chain outcome's probability."""
    best, best_rate = 0, -1.0
    for k in range(len(step_s)):
        # P(exactly a accepted) for a = 0..k, tokens emitted = a + 1
        tokens = 0.0
        for a in range(k + 1):
            p = math.prod(rates[:a]) * (1 - rates[a] if a < k else 1.0)
            tokens += p * (a + 1)
        if tokens / step_s[k] > best_rate + 1e-12:
            best, best_rate = k, tokens / step_s[k]
    return best


def test_estimates_converge_to_true_conditional_rates():
    rates = [0.9, 0.8, 0.6, 0.5, 0.3]
    adaptive = AdaptiveK(max_k=5, decay=1.0)
    rng = random.Random(0)
    for _ in range(2000):
        adaptive.observe(*draw_steps(rng, rates, k=5, batch=4))
    for estimate, rate in zip(adaptive.acceptance(), rates):
        assert estimate == pytest.approx(rate, abs=0.03)
    expected = 1 + sum(math.prod(rates[: i + 1]) for i in range(5))
    assert adaptive.expected_tokens(5) == pytest.approx(expected, abs=0.05)
    assert adaptive.expected_tokens(0) == 1.0


def test_observe_counts_seen_and_accepted_positions():
    adaptive = AdaptiveK(max_k=4, prior_weight=1e-9, decay=1.0)
    # rows: (n=4, a=1) sees 1,2 accepts 1; (n=2, a=2) sees 1,2 accepts 1,2; (n=3, a=0) sees 1
    adaptive.observe([4, 2, 3, 0], [1, 2, 0, 0])
    assert adaptive.seen == [3, 2, 0, 0]
    assert adaptive.accepted == [2, 1, 0, 0]
    assert adaptive.acceptance()[:2] == pytest.approx([2 / 3, 1 / 2])
    # unseen positions keep the prior
    assert adaptive.acceptance()[2:] == pytest.approx([0.7, 0.7])
    with pytest.raises(ValueError):
        adaptive.observe([2], [3])
    with pytest.raises(ValueError):
        adaptive.observe([5], [0])


def test_decay_follows_a_change_in_acceptance():
    adaptive = AdaptiveK(max_k=1, decay=0.9)
    for _ in range(100):
        adaptive.observe([1], [1])
    assert adaptive.acceptance()[0] > 0.9
    for _ in range(100):
        adaptive.observe([1], [0])
    # about the last 1 / (1 - decay) = 10 steps count, against a prior of 2 steps at 0.7
    assert adaptive.acceptance()[0] == pytest.approx(1.4 / 12, abs=1e-3)


def test_the_prior_keeps_early_choices_sane():
    adaptive = AdaptiveK(max_k=3, prior_acceptance=0.5)
    assert adaptive.acceptance() == [0.5, 0.5, 0.5]
    assert adaptive.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)


@pytest.mark.parametrize(
    "rates, step_s",
    [
        # cheap drafting, verify cost flat in k (dispatch-bound batch 1): a long chain pays
        ([0.9] * 8, [1.0 + 0.02 * k for k in range(9)]),
        # verify grows steeply with k (compute-bound batch 16): plain decoding
        ([0.6] * 8, [1.0 + 0.8 * k for k in range(9)]),
        # a knee in the middle
        ([0.95, 0.9, 0.7, 0.4, 0.3, 0.2, 0.1, 0.1], [1.0, 1.1, 1.2, 1.35, 1.6, 2.0, 2.5, 3.0, 3.5]),
        # acceptance near 0: drafts never pay
        ([0.01] * 8, [1.0 + 0.02 * k for k in range(9)]),
        # quadratic verify cost
        ([0.8] * 8, [1.0 + 0.05 * k * k for k in range(9)]),
    ],
)
def test_choose_matches_brute_force(rates, step_s):
    adaptive = AdaptiveK(max_k=8, decay=1.0, probe_every=0)
    rng = random.Random(1)
    for _ in range(3000):
        adaptive.observe(*draw_steps(rng, rates, k=8, batch=4))
    adaptive.set_costs(16, step_s)
    best = brute_force_best(rates, step_s)
    assert adaptive.choose(16) == best
    assert adaptive.predicted_speedup(16, best) >= adaptive.predicted_speedup(16, 0)


def test_extreme_cost_curves_give_the_extreme_k():
    adaptive = AdaptiveK(max_k=8, probe_every=0)
    adaptive.set_costs(1, [1.0 + 0.01 * k for k in range(9)])
    adaptive.set_costs(16, [1.0 + k for k in range(9)])
    assert adaptive.choose(1) == 8
    assert adaptive.choose(16) == 0
    for _ in range(50):
        adaptive.observe([8] * 4, [0] * 4)
    assert adaptive.choose(1) == 0
    assert adaptive.chosen == {8: 1, 0: 2}


def test_noisy_costs_are_kept_non_decreasing():
    """Warm-up timings on a busy machine (measured: k = 8 below k = 7, k = 2 below k = 1) would
    make a larger k look cheaper; each decreasing run is pooled to its mean instead."""
    measured = [21.7, 49.1, 47.0, 54.7, 50.9, 54.3, 61.7, 75.2, 64.6]
    smooth = non_decreasing(measured)
    assert smooth == pytest.approx([21.7, 48.05, 48.05, 52.8, 52.8, 54.3, 61.7, 69.9, 69.9])
    assert sum(smooth) == pytest.approx(sum(measured))
    assert non_decreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0] * 3) and non_decreasing([1.0, 2.0]) == [1.0, 2.0]
    adaptive = AdaptiveK(max_k=8, prior_acceptance=0.85, probe_every=0, confidence=0.0)
    adaptive.costs[1] = measured  # as they came
    assert adaptive.best_k(1) == 8  # k = 8 (64.6) undercuts k = 7 (75.2)
    adaptive.set_costs(1, measured)
    assert adaptive.costs[1] == pytest.approx(smooth)
    assert adaptive.best_k(1) == 5


def test_warmup_costs_lie_on_a_line_through_every_sample():
    """k = 0 keeps the median of its own steps; k >= 1 get the Theil-Sen line through all their
    samples, so a slow window (every sample of k = 3 doubled) and a quiet one (k = 7 at 0.7x)
    barely move it, where medians per k made k = 7 look cheaper than k = 6."""
    rng = random.Random(3)
    true = [20.0] + [24.0 + 4.0 * k for k in range(1, 9)]  # ms: a plain step, then a + b k
    samples = {k: [c * rng.uniform(0.95, 1.05) for _ in range(3)] for k, c in enumerate(true)}
    samples[3] = [2 * s for s in samples[3]]
    samples[7] = [0.7 * s for s in samples[7]]
    costs = fit_step_costs(samples, 8)
    assert sorted(costs) == list(range(9)) and costs[0] == sorted(samples[0])[1]
    points = [(k, s) for k in range(1, 9) for s in samples[k]]
    slopes = sorted((s2 - s1) / (k2 - k1) for k1, s1 in points for k2, s2 in points if k2 > k1)
    b = (slopes[len(slopes) // 2 - 1] + slopes[len(slopes) // 2]) / 2  # an even count: the middle two
    residuals = sorted(s - b * k for k, s in points)
    a = (residuals[11] + residuals[12]) / 2  # 24 samples
    assert [costs[k] for k in range(1, 9)] == pytest.approx([a + b * k for k in range(1, 9)])
    assert sorted(samples[7])[1] < sorted(samples[6])[1]  # the medians per k fall at k = 7
    assert all(costs[k + 1] > costs[k] for k in range(1, 8))
    assert max(abs(costs[k] - true[k]) / true[k] for k in range(1, 9)) < 0.08  # the median of k = 3: 2x


def test_warmup_costs_never_fall_with_k_and_need_two_ks_for_a_line():
    assert fit_step_costs({0: [1.0], 1: [5.0, 5.0], 2: [3.0, 3.0]}, 2) == {0: 1.0, 1: 4.0, 2: 4.0}  # flat
    assert fit_step_costs({0: [1.0, 3.0, 2.0], 2: [4.0, 6.0, 5.0]}, 2) == {0: 2.0, 2: 5.0}  # medians
    assert fit_step_costs({1: [2.0], 3: [4.0]}, 4) == pytest.approx({1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0})


def test_catch_up_costs_weigh_on_shallow_k_by_their_tokens():
    """A shallow k's emitted tokens cost ``catch_up_s[k]`` each later: k = 1 at 1.5 plain steps
    beats plain decoding (E(1) = 1.8), but not once each token costs 0.4 more (1.5 + 0.72)."""
    adaptive = AdaptiveK(max_k=2, prior_acceptance=0.8, probe_every=0)
    adaptive.set_costs(1, [1.0, 1.5, 3.0])
    assert adaptive.best_k(1) == 1 and adaptive.costs_now(1) == [1.0, 1.5, 3.0]
    adaptive.set_costs(1, [1.0, 1.5, 3.0], [0.0, 0.4, 0.0])
    assert adaptive.costs_now(1) == pytest.approx([1.0, 1.5 + 1.8 * 0.4, 3.0])
    assert adaptive.best_k(1) == 0 and adaptive.costs_now(4) == adaptive.costs_now(1)  # borrowed
    assert adaptive.predicted_speedup(1, 1) == pytest.approx(1.8 / 2.22)
    with pytest.raises(ConfigError, match="catch-up costs"):
        adaptive.set_costs(1, [1.0, 1.5, 3.0], [0.0, -1.0, 0.0])


def test_a_request_drafts_only_where_its_tokens_can_earn_back_the_prompt_pass():
    """P = 2. At k = 2 (E = 2.19 at 1.4 plain steps) each token a row emits saves 1 - 1.4 / 2.19
    = 0.361 plain steps; a 100-position prompt whose pass over both depths costs 1 plain step is
    earned back from 3 new tokens on. A request kept to 1 depth saves 1 - 1.2 / 1.7 = 0.294 a
    token (k = 1) for half the pass (0.5): earned back from 2 tokens on, not by 1. Where the pass
    was not measured only the best k decides; where the best k is 0 nothing is saved; a
    borrowed bucket prices by the rows its costs were measured with."""
    adaptive = AdaptiveK(max_k=2, prior_acceptance=0.7, probe_every=0, confidence=0.0)
    adaptive.set_costs(1, [1.0, 1.2, 1.4], prompt_s=0.01)
    assert adaptive.best_k(1) == 2
    assert adaptive.saving_per_token(1) == pytest.approx(1 - 1.4 / 2.19)
    assert not adaptive.drafting_pays_for(1, 100, 1) and adaptive.drafting_pays_for(1, 100, 2)
    assert adaptive.drafting_pays_for(2, 100, 2) and not adaptive.drafting_pays_for(2, 100, 1)  # bucket 1's
    adaptive.set_costs(4, [4.0, 4.8, 5.6], prompt_s=0.005)  # a batch of 4: a row's share is a quarter
    assert adaptive.saving_per_token(4) == pytest.approx((4.0 - 5.6 / 2.19) / 4)
    # the pass priced at batch 1's 0.01 per position (a prompt is mostly drafted alone), not 0.005
    # (at which 1 depth's pass, 0.25, would be earned back by one token's 0.294)
    assert not adaptive.drafting_pays_for(4, 100, 1) and adaptive.drafting_pays_for(4, 100, 2)
    adaptive.set_costs(1, [1.0, 1.2, 5.0], prompt_s=0.01)  # k = 2 too dear: 1 depth is all that drafts
    assert adaptive.drafting_pays_for(1, 100, 2) and not adaptive.drafting_pays_for(1, 200, 3)
    adaptive.set_costs(1, [1.0, 1.2, 1.4])  # the pass not measured
    assert adaptive.drafting_pays_for(1, 10**6, 1)
    adaptive.set_costs(1, [1.0, 100.0, 100.0], prompt_s=0.01)  # k = 0 best
    assert adaptive.saving_per_token(1) == 0.0 and not adaptive.drafting_pays_for(1, 1, 10**6)
    assert adaptive.summary()["prompt_s"] == {"1": 0.01, "4": 0.005}
    with pytest.raises(ConfigError, match="prompt pass"):
        adaptive.set_costs(1, [1.0, 1.2, 1.4], prompt_s=-1.0)


def test_a_request_keeps_the_depths_whose_drafts_pay_for_their_prompt_pass():
    """k_max = P = 4, E = 1, 1.7, 2.19, 2.533, 2.773 (prior 0.7), steps at 1.0 .. 1.8 plain steps:
    a token costs 0.706, 0.639, 0.632, 0.649 plain steps at k = 1..4, so 10 new tokens save most
    at k = 3, which 3 depths reach as well as 4 (ties: the fewer). A 100-position prompt's pass
    over all 4 depths costs 100 * prompt_s, over m depths m / 4 of that: at 0.1 plain steps
    m = 3 still wins (3.608 against 3.583 for m = 4), at 1 m = 2 (3.107 against 2.933), at 10
    m = 1 (0.44; m = 2 loses 1.39). An m that no running request drafts with adds a drafting
    round to each of the request's ``10 / E(m)`` steps, priced at a k = 1 step's extra 0.2. Without measured costs (the fallback model, 1 + 0.1 k,
    no pass price) the largest k saves most: all 4 depths."""
    adaptive = AdaptiveK(max_k=4, prior_acceptance=0.7, probe_every=0, confidence=0.0)
    assert adaptive.depths_for(1, 100, 10) == 4  # fallback model
    steps = [1.0, 1.2, 1.4, 1.6, 1.8]
    for prompt_s, depths in ((0.0, 3), (0.001, 3), (0.01, 2), (0.1, 1)):
        adaptive.set_costs(1, steps, prompt_s=prompt_s)
        assert adaptive.depths_for(1, 100, 10) == depths, prompt_s
        if prompt_s == 0.001:  # beside requests of 2 (1) depths, m = 3 adds a round: 10 / E(3) steps at 0.2
            assert adaptive.depths_for(1, 100, 10, running={2}) == 2  # 3.608 - 0.790 < 3.557
            assert adaptive.depths_for(1, 100, 10, running={1}) == 1  # 2.916 > 2.862 (m = 4)
        if prompt_s == 0.1:  # its own m still, where the running one's costs more than the round
            assert adaptive.depths_for(1, 100, 10, running={4}) == 1  # -0.74 > -6.3
    adaptive.set_costs(1, [1.0, 1.2, 1.4, 1.6, 1.75])  # k = 4 now just cheapest per token: 0.6311 < 0.6317
    assert adaptive.depths_for(1, 100, 10) == 4
    adaptive.set_costs(1, [1.0, 1.2, 1.4, 1.6, 1.75], prompt_s=0.001)  # the fourth depth's pass tips it
    assert adaptive.depths_for(1, 100, 10) == 3
    # a shallow step owes its catch-up of the depths it skips within the request's m: with k = 2 best
    # inside m = 3 or 4 (k = 3, 4 cost 1.9, 2.0), m = 2 drafts k = 2 with no catch-up at all
    adaptive.set_costs(1, [1.0, 1.2, 1.4, 1.9, 2.0], [0.0, 0.05, 0.05, 0.05, 0.0])
    assert adaptive.depths_for(1, 100, 10) == 2


def test_a_due_probe_waits_for_a_row_with_every_depth():
    """``choose(probe=False)``: no row of the round keeps every depth, so a due probe is not spent
    on rows that could not draft k_max; it stays due and runs at the next round that can."""
    adaptive = AdaptiveK(max_k=3, prior_acceptance=0.7, probe_every=3, probe_budget=0.0, max_backoff=0)
    adaptive.set_costs(1, [1.0, 1.1, 1.5, 2.0])
    best = adaptive.best_k(1)
    assert 1 <= best < adaptive.max_k  # a probe (k_max) is told apart from it
    assert [adaptive.choose(1) for _ in range(2)] == [best, best] and adaptive.steps_to_probe(1) == 1
    assert [adaptive.choose(1, probe=False) for _ in range(3)] == [best] * 3 and adaptive.probes == 0
    assert adaptive.steps_to_probe(1) <= 0  # still due
    assert adaptive.choose(1) == 3 and adaptive.probes == 1 and adaptive.steps_to_probe(1) == 3


def test_the_saving_is_priced_optimistically():
    """The saving is priced with every estimate at its upper bound, as whether to draft at all
    is decided: estimates that choose k = 0 but bounds that draft price a saving, and with
    observations the bounds close in on the estimates."""
    adaptive = AdaptiveK(max_k=1, prior_acceptance=0.5, probe_every=0, confidence=1.0)
    adaptive.set_costs(1, [1.0, 1.6], prompt_s=0.001)
    assert adaptive.best_k_at(1) == 0 and adaptive.best_k(1) == 1
    bound = adaptive.acceptance_bounds(1.0)[0]
    assert adaptive.saving_per_token(1) == pytest.approx(1 - 1.6 / (1 + bound))
    adaptive.observe([1] * 400, [1] * 300 + [0] * 100)  # alpha_1 about 0.75
    bound = adaptive.acceptance_bounds(1.0)[0]
    assert bound - adaptive.acceptance()[0] < 0.04
    assert adaptive.saving_per_token(1) == pytest.approx(1 - 1.6 / (1 + bound))


def test_rows_that_decode_plainly_pay_the_step_but_gain_nothing():
    """At batch 4 k = 2 pays where every row drafts (2.19 tokens at 1.4 plain steps); where only a
    quarter draft, a row emits 1 + 0.25 * 1.19 tokens at the same cost, so k = 0; half: k = 2
    still beats plain decoding (1.595 / 1.4) and k = 1 (1.35 / 1.2)."""
    adaptive = AdaptiveK(max_k=2, prior_acceptance=0.7, probe_every=0, confidence=0.0)
    adaptive.set_costs(4, [1.0, 1.2, 1.4])
    assert [adaptive.best_k(4, rows) for rows in ([2] * 4, [2, 2, 0, 0], [2, 0, 0, 0])] == [2, 2, 0]
    assert [adaptive.choose(4, rows) for rows in ([2] * 4, [2, 0, 0, 0])] == [2, 0]


def test_rows_kept_to_fewer_depths_cap_what_a_wider_k_buys():
    """k_max = P = 4, E = 1, 1.7, 2.19, 2.533, 2.773 (prior 0.7), steps at 1.0 .. 1.8 plain steps.
    Every row with every depth: k = 3 (2.533 / 1.6 = 1.583 beats 1.564 at k = 2). One row with
    every depth beside three kept to 1 depth: k = 2 emits (2.19 + 3 * 1.7) / 4 = 1.82 tokens a row
    at 1.4 (1.30 a step), below k = 1's 1.7 / 1.2 = 1.42, so k = 1; beside three kept to 2,
    k = 2 (1.564 against 2.275 / 1.6 = 1.42 at k = 3). Rows that all keep 2 depths take k = 2
    whatever k above it is asked: a wider k buys them nothing and ties go to the smaller k."""
    adaptive = AdaptiveK(max_k=4, prior_acceptance=0.7, probe_every=0, confidence=0.0)
    adaptive.set_costs(4, [1.0, 1.2, 1.4, 1.6, 1.8])
    assert adaptive.best_k(4) == adaptive.best_k(4, [4] * 4) == 3
    assert adaptive.best_k(4, [4, 1, 1, 1]) == 1 and adaptive.choose(4, [4, 1, 1, 1]) == 1
    assert adaptive.best_k(4, [4, 2, 2, 2]) == 2
    adaptive.set_costs(4, [1.0, 1.2, 1.3, 1.35, 1.4])  # k = 4 best with every depth; 2 depths: k = 2
    assert adaptive.best_k(4) == 4 and adaptive.best_k(4, [2] * 4) == 2
    # a shallow step owes the catch-up of the depths its rows keep beyond it: at k = 1 rows kept to
    # 2 depths owe 1/3 of what rows with all 4 owe (0.3 per token): 1.2 + 1.7 * 0.1 = 1.37 a step
    adaptive.set_costs(4, [1.0, 1.2, 3.0, 3.0, 3.0], [0.0, 0.3, 0.0, 0.0, 0.0])
    assert adaptive.best_k(4, [2] * 4) == 1  # 1.7 / 1.37 = 1.24 tokens a step
    assert adaptive.best_k(4) == 0  # 1.7 / (1.2 + 1.7 * 0.3) = 0.99


def test_drafting_must_promise_the_minimum_gain():
    """k = 1 promising 4 % more tokens/s than plain decoding (E(1) = 1.8 at 1.73 plain steps) is
    not worth the costs steps leave out: k = 0 unless ``min_gain`` allows it; 10 % is."""
    for min_gain, cost, best in [(0.05, 1.73, 0), (0.0, 1.73, 1), (0.05, 1.636, 1)]:
        adaptive = AdaptiveK(max_k=1, prior_acceptance=0.8, probe_every=0, min_gain=min_gain, confidence=0.0)
        adaptive.set_costs(16, [1.0, cost])
        assert adaptive.best_k(16) == best, (min_gain, cost)


def test_ties_go_to_the_smaller_k():
    adaptive = AdaptiveK(max_k=2, prior_acceptance=1.0, probe_every=0)
    adaptive.set_costs(1, [1.0, 2.0, 3.0])  # E(k) = 1 + k: the same tokens/s at every k
    assert adaptive.best_k(1) == 0


def test_without_costs_the_fallback_model_is_used():
    adaptive = AdaptiveK(max_k=4, prior_acceptance=0.9, fallback_draft_cost=0.1, probe_every=0)
    assert not adaptive.has_costs(4)
    step_s = [1.0 + 0.1 * k for k in range(5)]
    assert adaptive.choose(4) == brute_force_best([0.9] * 4, step_s)
    assert adaptive.predicted_speedup(4, 2) == pytest.approx((1 + 0.9 + 0.81) / 1.2)


def test_probing_happens_exactly_every_probe_every_steps_per_bucket():
    # every estimate 0 (a prior of 0, nothing observed): best is 0, though all accepted k = 6 would pay
    adaptive = AdaptiveK(max_k=6, prior_acceptance=0.0, probe_every=5, probe_budget=0.0, max_backoff=0)
    adaptive.set_costs(2, [1.0 + 0.5 * k for k in range(7)])
    adaptive.set_costs(8, [1.0 + 0.5 * k for k in range(7)])
    picks = [adaptive.choose(2) for _ in range(20)]
    assert [i + 1 for i, k in enumerate(picks) if k == 6] == [5, 10, 15, 20]
    assert all(k == 0 for i, k in enumerate(picks) if (i + 1) % 5)
    # buckets count their steps separately
    assert [adaptive.choose(8) for _ in range(5)] == [0, 0, 0, 0, 6]
    assert adaptive.probes == 5
    assert adaptive.chosen == {0: 20, 6: 5}


def test_an_unmeasured_bucket_borrows_the_nearest_measured_costs():
    """The smallest larger measured bucket, else the largest: never the optimistic fallback model
    once anything was measured (a batch's tail runs at buckets warm-up did not time)."""
    adaptive = AdaptiveK(max_k=2, prior_acceptance=0.9, probe_every=0)
    fallback = [1.0, 1.1, 1.2]
    assert adaptive.step_costs(4) == fallback and adaptive.best_k(4) == 2
    adaptive.set_costs(16, [1.0, 5.0, 6.0])
    adaptive.set_costs(2, [1.0, 1.5, 1.8])
    assert adaptive.step_costs(4) == adaptive.step_costs(8) == [1.0, 5.0, 6.0]
    assert adaptive.step_costs(1) == [1.0, 1.5, 1.8] and adaptive.step_costs(32) == [1.0, 5.0, 6.0]
    assert adaptive.best_k(4) == 0 and adaptive.best_k(1) == 2


def test_probes_are_spaced_by_their_cost():
    """A probe at k = 6 takes 4.5 steps at the best k (0) and is expected to emit E(6) = 1.98
    tokens, which plain steps emit in 1.98 steps: it costs 2.52 steps more, so with 5 % of the time
    for probes, one every ceil(2.52 / 0.05) = 51 calls; where k = 6 is best probes cost nothing."""
    adaptive = AdaptiveK(max_k=6, prior_acceptance=0.5, probe_every=5, probe_budget=0.05, max_backoff=0)
    adaptive.set_costs(1, [1.0] + [4.5] * 6)
    adaptive.set_costs(4, [1.0] * 7)
    assert adaptive.best_k(1) == 0 and adaptive.best_k(4) == 6
    assert adaptive.expected_tokens(6) == pytest.approx(1.984375)
    assert adaptive.probe_interval(1, 0) == 51 and adaptive.probe_interval(4, 6) == 5
    picks = [adaptive.choose(1) for _ in range(204)]
    assert [i + 1 for i, k in enumerate(picks) if k == 6] == [51, 102, 153, 204]
    assert [adaptive.choose(4) for _ in range(10)] == [6] * 10  # best anyway; probes at 5 and 10
    assert adaptive.probes == 6


def test_probes_at_best_k_zero_are_priced_for_one_drafting_row():
    """At best k = 0 one request of the bucket drafts for a probe, so at bucket 16 the probe's
    step (4.5 plain steps) buys E(6) = 1.98 tokens for one row and 1 for the other 15: 1.06 per
    row, 3.44 steps more than plain, a probe every ceil(3.44 / 0.05) = 69 steps (bucket 1: 51)."""
    adaptive = AdaptiveK(max_k=6, prior_acceptance=0.5, probe_every=5, probe_budget=0.05, max_backoff=0)
    for bucket in (1, 16):
        adaptive.set_costs(bucket, [1.0] + [4.5] * 6)
    assert adaptive.best_k(16) == 0
    assert adaptive.probe_interval(1, 0) == 51
    assert adaptive.probe_interval(16, 0) == math.ceil((4.5 - (1 + 0.984375 / 16)) / 0.05) == 69


def test_probes_are_priced_with_their_carriers_pass_over_the_deeper_depths():
    """A probe needs a request that keeps every depth, where one kept to the best k's depths would
    not pass over its prompt with the others. With 4 depths, best k = 2 (acceptance 0.9: E(2) =
    2.71, E(4) = 4.0951) and a pass of 0.01 s per position with all 4, a carrier admitted over
    100-position prompts (the mean of 50 and 150) spends 100 * 0.01 * 2 / 4 = 0.5 s more: 0.28
    steps at k = 2 on top of the probe's own 3.0 / 1.8 - 4.0951 / 2.71 = 0.16. With 1 % of the time
    for probes, one every 44 steps, against 16 before any request was admitted."""
    adaptive = AdaptiveK(max_k=4, prior_acceptance=0.9, decay=1.0, probe_every=1, probe_budget=0.01, confidence=0.0)
    adaptive.set_costs(1, [1.0, 1.5, 1.8, 2.5, 3.0], prompt_s=0.01)
    assert adaptive.best_k(1) == 2
    own = 3.0 / 1.8 - adaptive.expected_tokens(4) / adaptive.expected_tokens(2)
    assert adaptive.carrier_pass_s(1, 2) == 0.0 and adaptive.probe_interval(1, 2) == math.ceil(own / 0.01) == 16
    adaptive.note_admission(50)
    adaptive.note_admission(150)
    assert adaptive.carrier_pass_s(1, 2) == pytest.approx(0.5)
    assert adaptive.carrier_pass_s(1, 4) == 0.0 and adaptive.carrier_pass_s(1, 0) == pytest.approx(1.0)
    assert adaptive.probe_interval(1, 2) == math.ceil((own + 0.5 / 1.8) / 0.01) == 44


def test_probes_are_priced_as_served_where_that_costs_more_than_warm_up_said():
    """Warm-up prices a probe as one step at max_k: with 4 depths, best k = 2 (acceptance 0.9) and
    costs 1.8 / 3.0 at k = 2 / 4, it takes 1.67 steps at k = 2 and buys E(4) / E(2) = 1.51 steps'
    tokens, one probe every 16 steps at 1 %. As served, its drafting step and the verify after it
    took 2.5, then 4.0 steps that did not probe: the mean 3.25 less the one step a verify takes
    anyway is 2.25 steps, which spaces probes 74 steps apart, the pending one rescheduled from the
    previous probe. A measure below the priced step leaves the interval as priced."""
    adaptive = AdaptiveK(max_k=4, prior_acceptance=0.9, decay=1.0, probe_every=1, probe_budget=0.01, confidence=0.0)
    adaptive.set_costs(1, [1.0, 1.5, 1.8, 2.5, 3.0])
    gain = adaptive.expected_tokens(4) / adaptive.expected_tokens(2)
    assert adaptive.best_k(1) == 2 and adaptive.measured_probe_steps(1) is None
    assert adaptive.probe_interval(1, 2) == math.ceil((3.0 / 1.8 - gain) / 0.01) == 16
    picks = [adaptive.choose(1) for _ in range(16)]
    assert picks == [2] * 15 + [4]  # the first probe, at step 16
    adaptive.note_probe_steps(1, 2.5)  # 1.5 steps beyond a verify: less than priced
    assert adaptive.probe_interval(1, 2) == 16
    adaptive.note_probe_steps(1, 4.0)
    assert adaptive.measured_probe_steps(1) == pytest.approx(3.25)
    assert adaptive.probe_interval(1, 2) == math.ceil((2.25 - gain) / 0.01) == 74
    picks = [adaptive.choose(1) for _ in range(80)]
    assert [16 + i + 1 for i, k in enumerate(picks) if k == 4] == [16 + 74]
    assert adaptive.summary()["probe_steps"] == {"1": pytest.approx(3.25)}
    with pytest.raises(ValueError, match="finite number > 0"):
        adaptive.note_probe_steps(1, float("nan"))


def test_probes_back_off_while_the_best_k_stays():
    """Each probe after which the best k is unchanged and settled doubles the interval (up to
    2**max_backoff); a change of the best k resets it."""
    adaptive = AdaptiveK(max_k=2, prior_acceptance=0.5, decay=1.0, probe_every=5, probe_budget=0.0, max_backoff=2)
    adaptive.set_costs(1, [1.0, 1.6, 2.0])
    for _ in range(200):  # well measured: half of the drafts at each position accepted
        adaptive.observe([2, 2, 2, 2], [0, 0, 1, 2])
    assert adaptive.best_k(1) == 0 and adaptive.best_k_at(1, adaptive.confidence) == 0
    picks = [adaptive.choose(1) for _ in range(60)]
    assert [i + 1 for i, k in enumerate(picks) if k == 2] == [5, 10, 20, 40, 60]  # 5, 5, 10, 20, 20 apart
    adaptive.decay = 0.5  # the estimates follow the last few steps from here on
    for _ in range(15):
        adaptive.observe([2], [2])  # drafts now always accepted: k = 2 is best
    assert adaptive.best_k(1) == 2
    assert [adaptive.choose(1) for _ in range(20)] == [2] * 20
    assert adaptive.probes == 6  # the probe at call 80 saw the change: back to every 5 calls
    assert adaptive.probe_interval(1, 2) == 5 and adaptive._next_probe[1] == 85


def test_probes_do_not_back_off_while_doubt_could_change_the_choice():
    """A position seen once (position 3, rejected at a probe: 0.47 under the default prior) is not
    settled: the estimates choose k = 1, and so do they with the next position (2, measured at
    0.5) at its upper bound, but every estimate at its upper bound would choose k = 3, so probes
    keep their priced interval instead of backing off; once measured, they back off as before."""
    adaptive = AdaptiveK(max_k=3, decay=1.0, probe_every=5, probe_budget=0.0, max_backoff=2)
    adaptive.set_costs(1, [1.0, 1.3, 1.7, 1.9])
    for _ in range(50):
        adaptive.observe([2, 2], [2, 1])  # position 1 always accepted, position 2 half the time
    adaptive.observe([3], [2])  # position 3 rejected once
    assert adaptive.best_k(1) == adaptive.best_k_at(1) == 1 and adaptive.best_k_at(1, 1.0) == 3
    picks = [adaptive.choose(1) for _ in range(20)]
    assert picks == [3 if i % 5 == 4 else 1 for i in range(20)] and adaptive._backoff[1] == 0
    for _ in range(300):
        adaptive.observe([3, 3, 3, 3], [3, 3, 3, 2])  # positions 1-2 measured at about 1, 3 at 0.75
    assert adaptive.best_k(1) == adaptive.best_k_at(1, 1.0) == 3
    [adaptive.choose(1) for _ in range(40)]
    assert adaptive._backoff[1] == 2  # settled: the interval doubled at each probe since


def test_optimism_escapes_the_plain_decoding_trap():
    """Three early rejections at position 2 make plain decoding best by the estimates, and k = 0
    observes nothing: without probes, choosing by the estimates decodes plainly for good. Deciding
    optimistically whether to draft, it drafts, observes, and settles on the k the true rates make
    best."""
    rates = [0.85, 0.7, 0.85, 0.8]
    step_s = [1.0, 1.87, 2.05, 2.22, 2.4]  # batch 1, compiled on the CPU (the shipped checkpoint's ratios)
    best = brute_force_best(rates, step_s)
    assert best == 4
    for confidence, expect in [(0.0, 0), (1.0, best)]:
        adaptive = AdaptiveK(max_k=4, probe_every=0, confidence=confidence)
        adaptive.set_costs(1, step_s)
        adaptive.observe([4, 4, 4], [1, 1, 1])
        assert adaptive.best_k_at(1) == 0 and adaptive.best_k(1) == (4 if confidence else 0)
        rng = random.Random(0)
        for _ in range(400):
            k = adaptive.choose(1)
            if k:
                adaptive.observe(*draw_steps(rng, rates, k, 1))
        assert adaptive.best_k(1) == adaptive.best_k_at(1) == expect, confidence
        assert (adaptive.chosen[0] == 400) == (confidence == 0.0)


def simulate_tokens_per_s(
    rates: list[float], step_s: list[float], k: int | None, seed: int, tokens: int = 768, confidence: float = 1.0
) -> float:
    """Tokens per second of one request at batch 1 whose steps cost ``step_s[k]`` and accept drafts
    at conditional ``rates``: at a fixed k, or adaptive k (``k=None``) with its chosen k each step."""
    rng = random.Random(seed)
    adaptive = AdaptiveK(max_k=len(rates), confidence=confidence)
    adaptive.set_costs(1, step_s)
    seconds, emitted = 0.0, 0
    while emitted < tokens:
        k_now = adaptive.choose(1) if k is None else k
        drafts, accepted = draw_steps(rng, rates, k_now, 1)
        if k is None and k_now:
            adaptive.observe(drafts, accepted)
        seconds += step_s[k_now]
        emitted += accepted[0] + 1
    return emitted / seconds


@pytest.mark.parametrize(
    "step_s",
    [
        [5.55, 10.39, 11.36, 12.34, 13.32, 14.29, 15.27, 16.25, 17.22],  # compiled, batch 1 (ms, warm-up)
        [12.8] + [17.0 + 2.5 * k for k in range(1, 9)],  # eager, batch 1
    ],
)
def test_adaptive_k_runs_near_the_best_fixed_k(step_s):
    """Simulated requests of 768 tokens at the shipped checkpoint's measured rates (k = 7,
    compiled, stdlib) and measured step costs: adaptive k, learning from nothing, runs within 5 %
    of the best fixed k on average over 16 seeds and never below 0.85x (0.99x and 0.93x here);
    choosing by the bare estimates (``confidence`` 0, the old policy) gives 0.94x on average and
    0.77x at worst with the compiled costs (a seed trapped at k = 0)."""
    rates = [0.81, 0.59, 0.85, 0.80, 0.94, 0.87, 0.96, 0.9]
    seeds = range(16)
    best = max(sum(simulate_tokens_per_s(rates, step_s, k, s) for s in seeds) / len(seeds) for k in range(9))
    runs = [simulate_tokens_per_s(rates, step_s, None, s) / best for s in seeds]
    assert sum(runs) / len(runs) >= 0.95 and min(runs) >= 0.85, runs


def test_new_costs_restart_the_probe_schedule():
    """Costs set after steps were counted (a warm-up measuring them, a re-measurement) reprice the
    bucket's probes: its next probe is one interval at the new costs after the current step, and
    its backoff starts over; other buckets keep their schedules."""
    adaptive = AdaptiveK(max_k=2, prior_acceptance=0.5, probe_every=5, probe_budget=0.05, max_backoff=3)
    for _ in range(15):
        adaptive.choose(1)  # fallback costs: k = 2 best; probes at 5 and 10, the next at 20
    assert adaptive.probes == 2 and adaptive._backoff[1] == 1 and adaptive.steps_to_probe(1) == 5
    assert adaptive.choose(4) == 2 and adaptive.steps_to_probe(4) == 4
    adaptive.set_costs(1, [1.0, 2.0, 2.75])  # k = 0 best; a probe costs 2.75 - 1.75 = 1 step: every 20
    assert adaptive.best_k(1) == 0 and adaptive.probe_interval(1, 0) == 20
    assert adaptive.steps_to_probe(1) == 20 and adaptive._backoff[1] == 0
    picks = [adaptive.choose(1) for _ in range(20)]
    assert [i + 1 for i, k in enumerate(picks) if k == 2] == [20]
    assert adaptive.steps_to_probe(4) == 4  # untouched


def test_plain_steps_bring_probes_due():
    """Steps in which no request drafted (plain_step) count towards the next probe: a probe is
    due by decode steps, and runs at the next choose() call."""
    adaptive = AdaptiveK(max_k=3, prior_acceptance=0.0, probe_every=5, probe_budget=0.0, max_backoff=0)
    adaptive.set_costs(1, [1.0, 3.0, 3.0, 3.0])  # estimates 0: k = 0 best (all accepted, k = 3 would pay)
    assert adaptive.choose(1) == 0 and adaptive.steps_to_probe(1) == 4
    for _ in range(6):
        adaptive.plain_step(1)
    assert adaptive.steps_to_probe(1) == -2 and adaptive.probes == 0  # overdue: nothing chose yet
    assert adaptive.choose(1) == 3 and adaptive.probes == 1
    assert adaptive.steps_to_probe(1) == 5 and adaptive.chosen == {0: 1, 3: 1}


def test_no_probes_where_no_acceptance_could_make_drafting_pay():
    """At bucket 16 a step at k costs about k + 1 plain steps (a compute-bound verify): even with
    every draft accepted, k = 8 emits 9 tokens for 8.6 steps, 4.7 % more tokens/s, short of the
    5 % drafting must promise (shallow k < 8 less, with their catch-up). No observation could change the choice (k = 0), so bucket 16 is
    never probed and its requests can decode plainly from admission; bucket 1, where drafting
    could pay, is probed as before. Costs as measured at batch 16 (eager, shipped checkpoint)."""
    step_s = [0.0331, 0.0544, 0.0873, 0.1201, 0.1530, 0.1859, 0.2187, 0.2516, 0.2845]
    catch_up_s = [0.0] + [0.0057] * 7 + [0.0]  # shallow k < 8 pay later for the depths they skip
    adaptive = AdaptiveK(max_k=8, prior_acceptance=0.0, probe_every=5, probe_budget=0.0, max_backoff=0)
    adaptive.set_costs(16, step_s, catch_up_s)
    adaptive.set_costs(1, [1.0] + [2.0] * 8)
    assert not adaptive.drafting_could_pay(16) and adaptive.drafting_could_pay(1)
    assert not adaptive.drafting_could_pay(8)  # no costs of its own: batch 16's
    assert adaptive.steps_to_probe(16) == math.inf and adaptive.steps_to_probe(1) == 5
    assert {adaptive.choose(16) for _ in range(200)} == {0}
    assert [adaptive.choose(1) for _ in range(5)] == [0, 0, 0, 0, 8]
    assert adaptive.probes == 1
    adaptive.set_costs(16, [0.0331] + [0.05] * 8)  # cheaper drafting could pay: probed again
    assert adaptive.drafting_could_pay(16) and adaptive.steps_to_probe(16) == 5
    assert adaptive.drafting_could_pay(8)  # worked out anew from the costs it borrows
    # with min_gain 0 the 4.7 % of the measured costs is enough
    lenient = AdaptiveK(max_k=8, prior_acceptance=0.0, min_gain=0.0)
    lenient.set_costs(16, step_s, catch_up_s)
    assert lenient.drafting_could_pay(16)


def test_probing_can_be_switched_off():
    adaptive = AdaptiveK(max_k=6, probe_every=0)
    adaptive.set_costs(2, [1.0 + k for k in range(7)])
    assert {adaptive.choose(2) for _ in range(100)} == {0}
    assert adaptive.probes == 0


@pytest.mark.parametrize("probe_every", [4, 0])
def test_probes_refresh_long_positions(probe_every):
    """Position 3 is rejected until k = 2 is chosen, then always accepted: only probes see that."""
    adaptive = AdaptiveK(max_k=3, decay=0.9, probe_every=probe_every)
    adaptive.set_costs(1, [1.0, 1.1, 1.2, 1.3])
    for _ in range(100):
        k = adaptive.choose(1)
        adaptive.observe([k], [min(k, 2)])
    assert adaptive.best_k(1) == 2
    for _ in range(100):
        k = adaptive.choose(1)
        adaptive.observe([k], [k])
    assert adaptive.best_k(1) == (3 if probe_every else 2)
    assert (adaptive.acceptance()[2] > 0.9) == bool(probe_every)


@pytest.mark.parametrize(
    "bucket, step_s",
    [
        (1, [1.0, 1.0]),
        (1, [1.0, 1.0, 1.0, 1.0]),
        (1, [1.0, 0.0, 1.0]),
        (1, [1.0, -1.0, 1.0]),
        (1, [1.0, math.nan, 1.0]),
        (0, [1.0, 1.0, 1.0]),
    ],
)
def test_bad_costs_raise(bucket, step_s):
    adaptive = AdaptiveK(max_k=2)
    with pytest.raises(ConfigError, match="step costs"):
        adaptive.set_costs(bucket, step_s)
    assert not adaptive.has_costs(bucket)


# the twenty-sixth session's warm-up costs at batch 1, compiled (ms): k = 1 is as good as k = 2 when
# position 2 looks bad, while position 2's true rate (0.7-0.8 on most prompts) makes k = 2-3 best
TRAP_COSTS = [3.93, 6.04, 6.87, 7.68, 8.5, 9.31, 10.11, 10.92, 11.45]


def test_the_next_position_is_judged_at_its_upper_bound():
    """Three early rejections at position 2 make k = 1 and one depth best by the estimates, and
    neither observes position 2 again. The step's k and a request's depths are chosen again with
    that next position at its upper bound, so they draft it and observe it; once measured low, the
    bound closes and k = 1 with one depth stays best."""
    adaptive = AdaptiveK(max_k=8, probe_every=0)
    adaptive.set_costs(1, TRAP_COSTS, [0.15] * 9, prompt_s=0.14)
    adaptive.observe([2] * 3 + [1] * 6, [1] * 3 + [1] * 6)  # position 2 rejected 3 times in 3
    assert adaptive.best_k_at(1) == 1 and adaptive.best_k(1) >= 2
    assert adaptive.depths_for(1, 120, 64) >= 2
    for _ in range(100):
        adaptive.observe([2], [1])  # position 2 measured: always rejected
    assert adaptive.best_k(1) == adaptive.best_k_at(1) == 1
    assert adaptive.depths_for(1, 120, 64) == 1
    without = AdaptiveK(max_k=8, probe_every=0, confidence=0.0)  # no optimism: the bare estimates
    without.set_costs(1, TRAP_COSTS, [0.15] * 9, prompt_s=0.14)
    without.observe([2] * 3 + [1] * 6, [1] * 3 + [1] * 6)
    assert without.best_k(1) == 1 and without.depths_for(1, 120, 64) == 1


def test_a_request_enters_the_pool_as_one_unit_and_chooses_by_its_own_estimates():
    """A request whose drafts at position 2 are all rejected (one stdlib prompt: 0 of 31 at fixed
    k = 3) learns k = 1 for itself from its own counts, but enters the pool as one request, not
    31 observations: the next request starts from a pool that still drafts position 2."""
    adaptive = AdaptiveK(max_k=8, probe_every=0)
    adaptive.set_costs(1, TRAP_COSTS, [0.15] * 9, prompt_s=0.14)
    for _ in range(31):
        adaptive.observe([2], [1], requests=["odd"])
    assert adaptive.seen == [0.0] * 8  # nothing enters the pool while it runs
    own = adaptive.acceptance("odd")
    assert own[1] == pytest.approx((0 + 4 * 0.7) / (31 + 4)) and own[0] > 0.9
    assert adaptive.choose(1, [2], request="odd") == 1 and adaptive.best_k(1, [2]) == 2
    adaptive.finish_request("odd")
    assert adaptive.seen[:3] == pytest.approx([1.0, 1.0, 0.0]) and adaptive.accepted[:2] == pytest.approx([1.0, 0.0])
    pooled = 2 * 0.7 / 3  # one unit at 0 beside the prior's 2 at 0.7
    assert adaptive.acceptance()[1] == pytest.approx(pooled) and adaptive.acceptance("odd")[1] == pytest.approx(pooled)
    assert adaptive.depths_for(1, 120, 64) >= 2  # the next request still drafts position 2
    steps = AdaptiveK(max_k=8, probe_every=0)  # the same steps counted one by one (no requests named)
    steps.set_costs(1, TRAP_COSTS, [0.15] * 9, prompt_s=0.14)
    steps.observe([2] * 31, [1] * 31)
    assert steps.acceptance()[1] < 0.05 and steps.depths_for(1, 120, 64) == 1


def test_requests_weigh_by_how_often_they_reached_a_position_and_decay():
    """A request that reached a position fewer than ``request_cap`` times counts for that fraction
    of a request; earlier requests decay by ``request_decay`` at each one that reached the position."""
    adaptive = AdaptiveK(max_k=2, request_cap=4.0, request_decay=0.5)
    adaptive.observe([2, 1], [2, 0], requests=["a", "b"])  # a: positions 1-2 accepted; b: 1 rejected
    adaptive.observe([2], [1], requests=["a"])  # a: position 1 accepted, 2 rejected
    adaptive.finish_request("a")
    assert adaptive.seen == pytest.approx([0.5, 0.5]) and adaptive.accepted == pytest.approx([0.5, 0.25])
    adaptive.finish_request("b")
    assert adaptive.seen == pytest.approx([0.5 * 0.5 + 0.25, 0.5]) and adaptive.accepted == pytest.approx([0.25, 0.25])
    adaptive.finish_request("never observed")  # changes nothing
    assert adaptive.seen == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError):
        adaptive.observe([1, 1], [1, 0], requests=["c"])


def test_running_requests_count_in_the_pool_as_they_stand():
    """Requests side by side finish together (batch 16), so the pool counts each running request
    as it would enter it: 16 requests rejecting position 2 move the pool at once, and k = 2, which
    pays at position 2's prior, stops paying before any of them has finished."""
    adaptive = AdaptiveK(max_k=2, probe_every=0)
    adaptive.set_costs(16, [1.0, 1.6, 1.9])  # k = 1 pays at 0.85; k = 2 only while position 2 looks good
    ids = list(range(16))
    adaptive.observe([2] * 16, [2] * 16, requests=ids)  # a first step: everything accepted
    assert adaptive.best_k_at(16) == 2
    for _ in range(7):
        adaptive.observe([2] * 16, [1] * 16, requests=ids)  # then position 2 always rejected
    assert adaptive.seen == [0.0, 0.0]  # none has finished
    units, rates = adaptive.pool_counts()
    assert units == pytest.approx([16.0, 16.0]) and rates == pytest.approx([16.0, 16 / 8])
    assert adaptive.acceptance()[1] == pytest.approx((2.0 + 2 * 0.7) / (16 + 2))
    assert adaptive.best_k(16) == 1
    for i in ids:
        adaptive.finish_request(i)
    assert adaptive.pool_counts() == (adaptive.seen, adaptive.accepted) and adaptive.best_k(16) == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_k": -1},
        {"prior_acceptance": 1.5},
        {"prior_weight": 0},
        {"decay": 0},
        {"probe_every": -1},
        {"probe_budget": -0.1},
        {"probe_budget": 1.0},
        {"max_backoff": -1},
        {"min_gain": 1.0},
        {"request_weight": 0},
        {"request_cap": 0},
        {"request_decay": 0},
    ],
)
def test_bad_settings_raise(kwargs):
    with pytest.raises(ConfigError):
        AdaptiveK(**{"max_k": 2, **kwargs})


def test_summary_is_plain_json():
    adaptive = AdaptiveK(max_k=2)
    adaptive.set_costs(4, [1.0, 1.5, 2.0])
    adaptive.set_costs(16, [1.0, 2.0, 3.0])  # all accepted, k = 2 emits 3 tokens for 3 steps: never probed
    adaptive.observe([2, 2], [2, 1])
    k = adaptive.choose(4)
    summary = json.loads(json.dumps(adaptive.summary()))
    assert summary["chosen"] == {str(k): 1}
    assert summary["costs"] == {"4": [1.0, 1.5, 2.0], "16": [1.0, 2.0, 3.0]}
    assert summary["drafting_could_pay"] == {"4": True, "16": False}
    assert summary["acceptance"] == pytest.approx(adaptive.acceptance())
    assert summary["expected_tokens"] == pytest.approx([adaptive.expected_tokens(j) for j in range(3)])
    assert summary["best_k"] == {"4": adaptive.best_k(4), "16": 0}
