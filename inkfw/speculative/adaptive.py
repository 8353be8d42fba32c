"""Adaptive number of draft tokens (``spec.num_tokens=auto``): each engine step and batch bucket,
pick the k in 0..max_k that maximises expected tokens per second.

* **Acceptance, per request over a pool of requests.** ``alpha_i`` estimates the conditional
  acceptance of draft position i (docs/design.md §6): P(draft i accepted | drafts 1..i-1
  accepted). A verify step of a request with ``n`` drafts and ``a`` accepted *saw* positions
  1..min(a+1, n) and *accepted* 1..a. Acceptance varies far more between prompts than within one
  (a fixed k = 3 engine on the 12 stdlib prompts: position 2 accepted 0 of 31 times on the first,
  0.47-1.0 on the others), so each running request keeps counts of its own
  (:meth:`AdaptiveK.observe` with ``requests``), and the *pool* is built from finished requests
  (:meth:`AdaptiveK.finish_request`): each enters it as one unit per position it reached, at its
  own rate there (``min(1, seen / request_cap)`` of a unit where it reached the position fewer than
  ``request_cap`` times), the pool's earlier weight decayed by ``request_decay`` at each request
  that reached the position; a running request counts in it as it stands, as it would enter it
  (:meth:`AdaptiveK.pool_counts`: requests side by side finish together, and a pool of finished
  ones alone would learn nothing while they run). The pool's estimate has a prior of ``prior_weight`` units at
  ``prior_acceptance``: ``alpha_i = (acc_i + w p) / (seen_i + w)``; a running request's own is
  its counts over ``request_weight`` pseudo-observations at the finished requests' pool's:
  ``(acc_i^r + v alpha_i) / (seen_i^r + v)``. Admission, depths and probes price by the pool; a
  step whose one row is one request (batch 1) chooses by that request's estimates. Pooled by
  steps, as before, the first stdlib prompt's 7-10 rejections (the bench's warm-up and its first
  run) set the estimate every later request was admitted by: position 2 at 0.16-0.21, each request kept to 1 depth at k = 1, and only probes
  observed position 2 again (the trap, benchmarks/history.md "Twenty-seventh session"). Observations
  with no request named enter the pool at once, one unit per step that reached a position, old
  counts multiplied by ``decay`` at each :meth:`AdaptiveK.observe` call that sees the position.
* **Expected tokens** of one request at k: ``E(k) = 1 + sum_{i=1..k} prod_{j<=i} alpha_j``
  (``E(0) = 1``: the bonus token).
* **Cost.** ``step_s[k]``: seconds of one whole decode step (verify + drafting) at a batch bucket
  with k drafts, measured at warm-up (:func:`fit_step_costs`: k >= 1 on a robust line through
  every timed step) and kept non-decreasing in k (:meth:`AdaptiveK.set_costs`), plus for a
  shallow k (docs/design.md §2) the catch-up its ``E(k)`` tokens cost later, also measured at
  warm-up (:meth:`AdaptiveK.costs_now`). A bucket without measured costs
  borrows those of the nearest measured bucket; with none measured, it uses the model
  ``step_s[k] = 1 + fallback_draft_cost * k`` (relative units; drafting and the wider verify each
  cost a fixed fraction of a plain step).
* **Choice.** ``argmax_k bucket * E(k) / step_s[k]``; ties go to the smaller k. Rows differ in
  what they can draft: one admitted plainly or stopped drafting emits 1 token, one kept to
  ``m < P`` depths (below) ``E(min(k, m))``, and every row pays the step of the widest row's
  drafts, so the argmax is over the rows' mean tokens (:meth:`AdaptiveK.choose` takes the depths
  each row keeps). Before it did, one probe carrier among 13 rows kept to 2 depths at batch 16
  made every step verify 9 positions a row for drafts the others could not make (HumanEval's
  first batches at 0.66-0.70x plain). Where that is k = 0, the same argmax with each
  ``alpha_i`` raised to its upper bound
  ``alpha_i + confidence * sqrt(alpha_i (1 - alpha_i) / (seen_i + w))`` (at most 1;
  ``confidence`` 1 by default, 0 switches it off; for a request's estimates ``seen_i^r + v``):
  whether to draft at all is decided
  optimistically, because k = 0 observes nothing and so cannot correct itself, while a drafting
  step observes positions 1.. and probes observe the rest. Where the estimates' best is some
  ``b`` in 1..max_k - 1, the choice is made again with the *next position*, ``b + 1``, at its
  upper bound: k = b never observes it either, so a position that a few early rejections priced
  low is drafted until its bound closes (:meth:`AdaptiveK.best_k`; a request's depths likewise,
  below). Choosing by the estimates alone
  trapped: at batch 1 two early rejections at position 2 (0.35 under the default prior, where
  0.6-0.8 is usual) made k = 0 best, and one probe every 32+ steps added one observation each, so
  plain decoding held for 250 of 400 steps (compiled, shipped checkpoint).
  ``tests/test_adaptive.py::test_adaptive_k_runs_near_the_best_fixed_k`` simulates that run's
  costs and rates; a drafter whose drafts are mostly rejected pays about 1 % for the optimism (a
  few early drafting steps). Drafting
  must promise ``min_gain`` (5 %) more tokens/s than plain decoding, else k = 0: the step costs
  leave out what drafting costs besides steps (the drafter's pass over each admitted prompt, host
  bookkeeping), which a break-even k does not earn back (batch 16 on the CPU: k = 1 promised 4 %
  and ran 14-22 % below plain).
* **Admission.** A request's drafter first passes over its whole prompt (every depth, eagerly),
  which no step cost includes. Warm-up measures that pass per prompt position (``prompt_s``,
  batch seconds, :meth:`AdaptiveK.set_costs`), and a request is drafted for only where its
  ``new_tokens`` at most could earn back that pass over some number ``m`` of depths (below):
  ``new_tokens * saving(m) > positions * prompt_s * m / P`` (:meth:`AdaptiveK.drafting_pays_for`),
  with ``saving(m)`` one row's share of ``step_s[0] / E(0) - step_s[k] / E(min(k, m))``, priced
  optimistically (every estimate at its upper bound, k the best there: a request admitted
  plainly observes nothing). Priced with every depth's pass, a 199-token HumanEval prompt was
  admitted plainly at batch 16 where 1 depth paid, and decoded alone for 25 steps after the
  batch beside it had finished (0.95x plain for that batch). Else it decodes plainly
  from admission, unless a probe falls due soon and no other running request drafts (the
  engine's ``_admits_plainly``: with every request admitted plainly nothing would ever be
  observed again, and no probe could run). The pass is priced at the larger of the bucket's
  and batch 1's ``prompt_s``: continuous batching mostly admits one request at a time, and a
  prompt drafted alone cost about twice per position what warm-up's four prompts side by side
  did (0.25-0.30 against 0.15 ms at batch 4, compiled). Without the price, compiled auto at
  batch 4 drafted every HumanEval request at k = 8, whose steps save 0.4-0.55 ms per token: 64
  new tokens did not earn back a 130-position pass, and the run went at 0.78x plain; with it,
  1.03-1.07x (benchmarks/history.md, "Eleventh session").
* **Depths per request.** A request admitted to draft keeps only depths ``0 .. m - 1``
  (:meth:`AdaptiveK.depths_for`, by the pool's estimates, then again with position ``m + 1`` at
  its upper bound, as for the next position of a step's k): it then drafts at most ``m`` tokens a step,
  its prompt pass runs ``m`` depths (``m / P`` of the whole pass) and nothing deeper ever
  catches up over its positions. ``m`` maximises what its ``new_tokens`` save at the best
  ``k <= m`` less that pass. Fixed k = 2 ran 5-12 % ahead of ``auto`` at batch 1, compiled, where
  auto kept all 8 depths and paid their pass over each prompt, or their catch-up, for steps that
  chose k = 2-4 (benchmarks/history.md, "Fifteenth session"). A probe drafts ``max_k`` for rows that keep
  every depth only; where none does, a due probe waits (``choose(probe=False)``), and the
  engine admits a request with every depth when a probe falls due within its expected steps
  and no running request keeps them all.
* **Probing.** Positions beyond the chosen k are never observed, so their estimates go stale.
  Some steps of a bucket (:meth:`AdaptiveK.choose` calls, and :meth:`AdaptiveK.plain_step`
  calls for steps in which no request drafted) choose max_k instead (a probe), so every
  position keeps being measured. Probes cost time, so they are spaced: with ``b`` the best k at
  a bucket's first call and at each probe, the next probe comes
  ``max(probe_every, ceil(((step_s[max_k] + carrier_s) / step_s[b] - E(max_k) / E(b)) / probe_budget)) * 2**backoff``
  steps later: a probe's net extra time (its step and its carrier's pass, less the steps at ``b``
  that would emit the tokens it is expected to emit), in steps at ``b``, over the share of decode
  time probes may take. A probe needs a *carrier*, a request that keeps every depth (the engine
  admits one when a probe falls due within its steps), where it would otherwise keep about ``b``:
  ``carrier_s`` is the drafter's pass with the other ``P - b`` depths over a prompt of the mean
  length admitted to draft (:meth:`AdaptiveK.note_admission`, decayed), ``positions * prompt_s *
  (P - b) / P``. Without it, a probe every 32 steps at batch 1 (compiled, stdlib prompts) cost
  about 10 % of decode time, not 2 %: nearly every request carried every depth, and each probe
  also ran the deferred depths over every position since the last (20 ms, against a 5 ms step).
  That catch-up is an eager round that warm-up's static step at ``max_k`` leaves out, so the
  engine also times probes as served (:meth:`AdaptiveK.note_probe_steps`): a probe's drafting
  step and the verify after it, in steps that did not probe. That less one step replaces
  ``step_s[max_k] / step_s[b]`` in the price where it is larger (at batch 1 compiled, HumanEval,
  the two took 6.0 steps where the costs said 1 + 1.7: half as many probes).
  At ``b = 0`` only one request of the bucket drafts for a probe (the engine admits the others
  plainly), so its tokens are ``1 + (E(max_k) - 1) / bucket`` per row instead of ``E(max_k)``.
  ``backoff`` counts the probes in a row at which the best k was what it had been at the probe
  before *and* settled (capped at ``max_backoff``; back to 0 otherwise): while nothing changes
  and nothing could, probes grow rarer. The best k is settled when the optimistic argmax (every
  estimate at its upper bound) is the same k: while doubt could change the choice, probes keep
  coming at the priced interval (backing off on an unchanged best alone froze a position seen
  once: k = 4 for 140 steps with position 5 at 0.47 from one rejection, where k = 7-8 ran best).
  A bucket where no acceptance could make drafting pay (:meth:`AdaptiveK.drafting_could_pay`:
  with every draft accepted, ``E(k) = k + 1``, no k beats plain decoding by ``min_gain``) is
  never probed: no observation could change its choice from k = 0, so a probe would be pure cost
  (batch 16 on the CPU, where a step at k costs about k + 1 plain steps and all-accepted k = 8
  promised 4.7 %: its 2 probes cost about 1 % of decode time).
  Deterministic; ``probe_every=0`` switches probing off, ``probe_budget=0``
  and ``max_backoff=0`` give a probe exactly every ``probe_every`` steps. A probe falls due at
  a step; it runs at the next choose() call. New costs (:meth:`set_costs`) reprice a bucket's
  probes: its schedule (next probe, backoff) starts over from its current step.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Any

from inkfw.errors import ConfigError
from inkfw.speculative.metrics import drafts_reached


class DecayedMean:
    """A mean whose old values weigh ``decay`` less at each new one (a decayed sum over a decayed
    count): the admitted prompts a probe's carrier is priced by, and probes as served."""

    def __init__(self, decay: float) -> None:
        self.decay, self.total, self.count = decay, 0.0, 0.0

    def add(self, value: float) -> None:
        self.total = self.total * self.decay + value
        self.count = self.count * self.decay + 1.0

    @property
    def mean(self) -> float | None:
        """None before any value."""
        return self.total / self.count if self.count else None


def non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent
    violators: each run that decreases is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count] of each pooled run
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


def fit_step_costs(samples: Mapping[int, Sequence[float]], max_k: int) -> dict[int, float]:
    """Step costs for k = 0 .. max_k from warm-up timings ``samples`` (k -> seconds of single
    steps). k = 0, a plain step with no drafting round, is the median of its own samples. k >= 1
    lie on a line ``a + b k`` through the samples of every k >= 1 (Theil-Sen: ``b`` the median of
    the slopes between samples of different k, at least 0 since more drafts never cost less
    work; ``a`` the median of ``s - b k``). A step at k drafts k tokens (shallow rounds,
    docs/design.md §2) and verifies k + 1, so its cost grows about linearly in k; on a shared
    machine such a line is much steadier than a median per k, whose noise (up to 30 % per k
    here) could make a large k look as cheap as a small one, and a window of load that slows
    every sample of one k barely moves it. With samples at fewer than two k >= 1, those k get
    their median. k without samples are left out."""
    costs = {0: statistics.median(samples[0])} if samples.get(0) else {}
    points = [(k, s) for k, ss in samples.items() if 1 <= k <= max_k for s in ss]
    ks = {k for k, _ in points}
    if len(ks) < 2:
        return costs | {k: statistics.median(samples[k]) for k in ks}
    slopes = [(s2 - s1) / (k2 - k1) for i, (k1, s1) in enumerate(points) for k2, s2 in points[i + 1 :] if k2 != k1]
    slope = max(0.0, statistics.median(slopes))
    base = statistics.median(s - slope * k for k, s in points)
    return costs | {k: base + slope * k for k in range(1, max_k + 1)}


class AdaptiveK:
    """Chooses the number of draft tokens per engine step and batch bucket (see the module doc)."""

    def __init__(
        self,
        max_k: int,
        lookahead: int | None = None,
        prior_acceptance: float = 0.7,
        prior_weight: float = 2.0,
        decay: float = 0.99,
        probe_every: int = 32,
        fallback_draft_cost: float = 0.1,
        probe_budget: float = 0.02,
        max_backoff: int = 4,
        min_gain: float = 0.05,
        confidence: float = 1.0,
        request_weight: float = 4.0,
        request_cap: float = 4.0,
        request_decay: float = 0.9,
    ) -> None:
        if max_k < 0:
            raise ConfigError(f"max_k must be >= 0, got {max_k}.")
        if lookahead is not None and not 0 <= lookahead <= max_k:
            raise ConfigError(f"the drafter's depths P must be in 0..max_k = {max_k}, got {lookahead}.")
        if not 0.0 <= prior_acceptance <= 1.0 or prior_weight <= 0:
            raise ConfigError(
                f"need 0 <= prior_acceptance <= 1 and prior_weight > 0, got {prior_acceptance} and {prior_weight}."
            )
        if not 0.0 < decay <= 1.0:
            raise ConfigError(f"decay must be in (0, 1], got {decay}.")
        if probe_every < 0:
            raise ConfigError(f"probe_every must be >= 0 (0: never probe), got {probe_every}.")
        if not 0.0 <= probe_budget < 1.0 or max_backoff < 0:
            raise ConfigError(f"need 0 <= probe_budget < 1 and max_backoff >= 0, got {probe_budget} and {max_backoff}.")
        if not fallback_draft_cost >= 0:
            raise ConfigError(f"fallback_draft_cost must be >= 0, got {fallback_draft_cost}.")
        if not 0.0 <= min_gain < 1.0:
            raise ConfigError(f"min_gain must be in [0, 1), got {min_gain}.")
        if not (math.isfinite(confidence) and confidence >= 0):
            raise ConfigError(f"confidence must be a finite number >= 0, got {confidence}.")
        if not (request_weight > 0 and request_cap > 0 and 0.0 < request_decay <= 1.0):
            raise ConfigError(
                "need request_weight > 0, request_cap > 0 and 0 < request_decay <= 1, got "
                f"{request_weight}, {request_cap} and {request_decay}."
            )
        self.max_k = max_k
        self.lookahead = max_k if lookahead is None else lookahead  # P: the depths a request drafts with at most
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.decay = decay
        self.probe_every = probe_every
        self.fallback_draft_cost = fallback_draft_cost
        self.probe_budget = probe_budget
        self.max_backoff = max_backoff
        self.min_gain = min_gain
        self.confidence = confidence
        self.request_weight = request_weight
        self.request_cap = request_cap
        self.request_decay = request_decay
        # the pool: [i] decayed weight of the requests (or anonymous steps) that reached draft
        # position i+1, and of their acceptance rates there (observe(), finish_request())
        self.seen = [0.0] * max_k
        self.accepted = [0.0] * max_k
        self._requests: dict[Hashable, tuple[list[float], list[float]]] = {}  # running -> (seen, accepted)
        self._running: tuple[list[float], list[float]] | None = None  # their units in the pool (_running_units)
        self.costs: dict[int, list[float]] = {}  # bucket -> step_s[0..max_k]
        self.catch_up: dict[int, list[float]] = {}  # bucket -> seconds per emitted token, later (set with costs)
        self.prompt_s: dict[int, float] = {}  # bucket -> seconds of the drafter's pass per prompt position
        self.steps: Counter[int] = Counter()  # bucket -> steps (choose() and plain_step() calls)
        self._next_probe: dict[int, int] = {}  # bucket -> the step from which the next choose() probes
        self._probe_best: dict[int, int] = {}  # bucket -> best k at its previous probe
        self._probe_step: dict[int, int] = {}  # bucket -> the step of its previous probe
        self._probe_steps: dict[int, DecayedMean] = {}  # bucket -> measured probe pairs (note_probe_steps)
        self._backoff: Counter[int] = Counter()  # bucket -> doublings of its probe interval
        self.chosen: Counter[int] = Counter()  # k -> times chosen (probes included)
        self.probes = 0
        self._admitted = DecayedMean(decay)  # prompt positions of the requests admitted to draft
        self._could_pay: dict[int, bool] = {}  # bucket -> drafting_could_pay, until the next set_costs

    def observe(
        self, num_drafts: Sequence[int], num_accepted: Sequence[int], requests: Sequence[Hashable] | None = None
    ) -> None:
        """Record one verify step: per row, ``num_drafts`` drafted and the first ``num_accepted`` of
        them accepted (host ints, ``0 <= a <= n <= max_k``). ``requests``: the request of each row;
        its counts build its own estimates and enter the pool when it finishes
        (:meth:`finish_request`). None: the rows enter the pool at once, one unit per step that
        reaches a position, decayed by ``decay`` (for callers that do not track requests)."""
        if len(num_drafts) != len(num_accepted) or (requests is not None and len(requests) != len(num_drafts)):
            raise ValueError(f"{len(num_drafts)} num_drafts but {len(num_accepted)} num_accepted (or requests)")
        step = [0.0] * self.max_k, [0.0] * self.max_k  # the step's own counts (no requests named)
        for row, (n, a) in enumerate(zip(num_drafts, num_accepted)):
            if not 0 <= a <= n <= self.max_k:
                raise ValueError(f"need 0 <= num_accepted <= num_drafts <= {self.max_k}, got {a} and {n}")
            counts = (
                step
                if requests is None
                else self._requests.setdefault(requests[row], ([0.0] * self.max_k, [0.0] * self.max_k))
            )
            for i in range(drafts_reached(n, a)):
                counts[0][i] += 1
                counts[1][i] += i < a
        if requests is not None:
            self._running = None
            return
        seen, accepted = step
        for i in range(self.max_k):
            if seen[i]:
                self.seen[i] = self.decay * self.seen[i] + seen[i]
                self.accepted[i] = self.decay * self.accepted[i] + accepted[i]

    def finish_request(self, request: Hashable) -> None:
        """``request`` has finished: its counts enter the pool as one unit per position it reached
        (less where it reached a position fewer than ``request_cap`` times: weight ``min(1, seen /
        request_cap)``), at its own acceptance rate there, the pool's earlier weight decayed by
        ``request_decay`` (module doc). Unknown requests (never observed) change nothing."""
        counts = self._requests.pop(request, None)
        if counts is None:
            return
        self._running = None
        for i, (seen, weight, accepted) in enumerate(zip(counts[0], *self._as_units(counts))):
            if seen:
                self.seen[i] = self.request_decay * self.seen[i] + weight
                self.accepted[i] = self.request_decay * self.accepted[i] + accepted

    def _as_units(self, counts: tuple[list[float], list[float]]) -> tuple[list[float], list[float]]:
        """One request's ``(seen, accepted)`` counts as it enters the pool: per position, its weight
        ``min(1, seen / request_cap)`` and that weight times its rate there (0 where unseen)."""
        units = [min(1.0, n / self.request_cap) for n in counts[0]]
        return units, [u * a / n if n else 0.0 for u, n, a in zip(units, *counts)]

    def _running_units(self) -> tuple[list[float], list[float]]:
        """The running requests as they stand, summed as they would enter the pool
        (:meth:`_as_units`), kept until the next :meth:`observe` with requests or
        :meth:`finish_request`."""
        if self._running is None:
            units, rates = [0.0] * self.max_k, [0.0] * self.max_k
            for counts in self._requests.values():
                for i, (u, r) in enumerate(zip(*self._as_units(counts))):
                    units[i] += u
                    rates[i] += r
            self._running = units, rates
        return self._running

    def pool_counts(self) -> tuple[list[float], list[float]]:
        """The pool's weight per position and its accepted weight: the finished requests' (and
        anonymous steps'), plus each running request's units as it stands. Requests that run side
        by side finish together (batch 16: 16 requests of 64 tokens), and a pool of finished ones
        alone would learn nothing while they run."""
        units, rates = self._running_units()
        return [s + u for s, u in zip(self.seen, units)], [a + r for a, r in zip(self.accepted, rates)]

    def acceptance(self, request: Hashable | None = None) -> list[float]:
        """Conditional acceptance estimates ``alpha_1..alpha_max_k`` (docs/design.md §6): the pool's
        (:meth:`pool_counts`, running requests included), or with ``request`` (a running request
        observed before) that request's own counts over ``request_weight`` pseudo-observations at the
        finished requests' estimates."""
        own = None if request is None else self._requests.get(request)
        if own is None:
            return self._with_prior(*self.pool_counts())
        v, finished = self.request_weight, self._with_prior(self.seen, self.accepted)
        return [(acc + v * q) / (n + v) for n, acc, q in zip(*own, finished)]

    def _with_prior(self, seen: Sequence[float], accepted: Sequence[float]) -> list[float]:
        """``(acc_i + w p) / (seen_i + w)``: pooled counts with the prior's ``prior_weight`` units at
        ``prior_acceptance``."""
        w, p = self.prior_weight, self.prior_acceptance
        return [(acc + w * p) / (n + w) for n, acc in zip(seen, accepted)]

    def expected_tokens(self, k: int) -> float:
        """``E(k)``: expected tokens one request emits per step with k drafts."""
        return self.expected_tokens_all()[k]

    def acceptance_bounds(self, confidence: float, request: Hashable | None = None) -> list[float]:
        """Upper bounds of ``alpha_1..alpha_max_k`` (:meth:`acceptance`, of the pool or of
        ``request``): each estimate plus ``confidence`` of its standard error over ``seen_i + w``
        observations (the pool: its weight in requests plus the prior's ``prior_weight``; a request:
        its own observations plus ``request_weight``), at most 1."""
        return self._bounds_of(self.acceptance(request), confidence, request)

    def _bounds_of(self, estimates: Sequence[float], confidence: float, request: Hashable | None) -> list[float]:
        """:meth:`acceptance_bounds` of ``estimates``, already worked out (``acceptance(request)``)."""
        own = None if request is None else self._requests.get(request)
        seen, w = (self.pool_counts()[0], self.prior_weight) if own is None else (own[0], self.request_weight)
        return [min(1.0, a + confidence * math.sqrt(a * (1.0 - a) / (n + w))) for a, n in zip(estimates, seen)]

    def expected_tokens_all(self, acceptance: Sequence[float] | None = None) -> list[float]:
        """``E(0) .. E(max_k)`` in one pass over the estimates (or over ``acceptance``)."""
        totals, chain = [1.0], 1.0
        for alpha in self.acceptance() if acceptance is None else acceptance:
            chain *= alpha
            totals.append(totals[-1] + chain)
        return totals

    def set_costs(
        self, bucket: int, step_s: Sequence[float], catch_up_s: Sequence[float] | None = None, prompt_s: float = 0.0
    ) -> None:
        """Measured seconds of one whole decode step at batch ``bucket`` with k drafts, k = 0..max_k.
        A step with more drafts does at least the work of one with fewer, so the costs kept are
        the closest non-decreasing ones (:func:`non_decreasing`): timing noise must not make a
        larger k look cheaper. ``catch_up_s[k]``: seconds each token a step at k emits (per
        request) costs later, when the depths a shallow round skipped run over its position
        (docs/design.md §2; 0 where rounds run every depth); a step at k then costs
        ``step_s[k] + E(k) * catch_up_s[k]`` (:meth:`costs_now`). ``prompt_s``: seconds of the
        drafter's pass over an admitted prompt, per prompt position, in a batch of ``bucket``
        (:meth:`drafting_pays_for`; 0: not measured). The bucket's probes are priced anew: its
        schedule starts over from its current step."""
        values = [float(s) for s in step_s]
        if bucket < 1 or len(values) != self.max_k + 1 or not all(math.isfinite(s) and s > 0 for s in values):
            raise ConfigError(
                f"step costs need a bucket >= 1 and {self.max_k + 1} finite positive seconds (k = 0..{self.max_k}), "
                f"got bucket {bucket} and {values}."
            )
        later = [0.0] * len(values) if catch_up_s is None else [float(c) for c in catch_up_s]
        if len(later) != len(values) or not all(math.isfinite(c) and c >= 0 for c in later):
            raise ConfigError(f"catch-up costs need {len(values)} finite seconds >= 0, got {later}.")
        if not (math.isfinite(prompt_s) and prompt_s >= 0):
            raise ConfigError(f"the prompt pass's cost must be finite seconds >= 0, got {prompt_s}.")
        self.costs[bucket] = non_decreasing(values)
        self.catch_up[bucket] = later
        self.prompt_s[bucket] = float(prompt_s)
        self._next_probe.pop(bucket, None)
        self._probe_best.pop(bucket, None)
        self._probe_step.pop(bucket, None)
        self._backoff.pop(bucket, None)
        self._could_pay.clear()  # a bucket without costs of its own borrows the nearest measured one's

    def has_costs(self, bucket: int) -> bool:
        return bucket in self.costs

    def step_costs(self, bucket: int) -> list[float]:
        """Measured ``step_s[0..max_k]`` of ``bucket``; else those of the nearest measured bucket
        (the smallest larger one, else the largest), whose ratios between k are what the choice
        uses; else the fallback model's relative costs."""
        measured = self._measured_bucket(bucket)
        if measured is not None:
            return self.costs[measured]
        return [1.0 + self.fallback_draft_cost * k for k in range(self.max_k + 1)]

    def _measured_bucket(self, bucket: int) -> int | None:
        """``bucket`` if measured, else the smallest larger measured bucket, else the largest (None:
        nothing measured)."""
        if bucket in self.costs or not self.costs:
            return bucket if bucket in self.costs else None
        larger = [b for b in self.costs if b > bucket]
        return min(larger) if larger else max(self.costs)

    def costs_now(self, bucket: int) -> list[float]:
        """Seconds of a step at k = 0..max_k with today's estimates where every row keeps every
        depth: :meth:`step_costs` plus the catch-up its ``E(k)`` emitted tokens cost later
        (:meth:`set_costs`, measured with the same bucket's step costs; :meth:`_row_steps`)."""
        return self._row_steps(bucket, None)[1]

    def best_k_at(
        self,
        bucket: int,
        confidence: float = 0.0,
        row_depths: Sequence[int] | None = None,
        request: Hashable | None = None,
    ) -> int:
        """The k maximising expected tokens/s at ``bucket`` now with every estimate (the pool's, or
        ``request``'s: :meth:`acceptance`) at its upper bound at ``confidence`` (0: the estimates
        themselves; no probing, nothing recorded), for rows that keep ``row_depths``
        (:meth:`_row_steps`)."""
        acceptance = self.acceptance_bounds(confidence, request) if confidence else self.acceptance(request)
        return self._best_k_given(bucket, acceptance, row_depths)

    def drafting_could_pay(self, bucket: int) -> bool:
        """Whether any acceptance could make drafting pay at ``bucket``: with every draft accepted
        (``E(k) = k + 1``) some k >= 1 beats plain decoding by ``min_gain``. Where none could, no
        observation could change the choice from k = 0, so the bucket is never probed. It depends
        on the costs alone (with ``max_k`` and ``min_gain``, fixed at construction), so it is worked
        out once per bucket after each :meth:`set_costs` (every :meth:`choose` asks: half of its
        time before)."""
        could = self._could_pay.get(bucket)
        if could is None:
            could = self._could_pay[bucket] = self._best_k_given(bucket, [1.0] * self.max_k) != 0
        return could

    def _row_steps(
        self, bucket: int, acceptance: Sequence[float] | None, row_depths: Sequence[int] | None = None
    ) -> tuple[list[float], list[float]]:
        """Tokens a row emits per step on average and seconds of a step at ``bucket``, k =
        0..max_k, with conditional acceptances ``acceptance`` (None: the estimates), for rows that
        keep ``row_depths`` (module doc; None: one row with every depth, as every row of a batch
        that drafts alike). A row kept to ``m < P`` depths drafts ``min(k, m)`` and emits
        ``E(min(k, m))``; one that decodes plainly (``m = 0``) emits 1; one with every depth drafts
        k. Every row pays the step of the widest row's drafts, and a row whose ``min(m, P)``
        depths a shallow step at ``k`` leaves behind owes ``(min(m, P) - k) / (P - k)`` of the
        catch-up measured for all ``P - k``."""
        P, expected = self.lookahead, self.expected_tokens_all(acceptance)
        kinds = Counter(min(m, P) for m in row_depths or [P])  # depths kept -> rows (a few kinds)
        n = sum(kinds.values())
        caps = {m: self.max_k if m >= P else m for m in kinds}  # the drafts each kind takes at most
        step_s = self.step_costs(bucket)
        measured = self._measured_bucket(bucket)  # catch-up measured with those costs (none: set without)
        later = (None if measured is None else self.catch_up.get(measured)) or [0.0] * len(step_s)
        tokens, seconds = [], []
        for k in range(self.max_k + 1):
            width = min(k, max(caps.values()))  # the drafts of the step's widest row
            owed = sum(c * expected[width] * (m - width) / (P - width) for m, c in kinds.items() if width < m)
            tokens.append(sum(c * expected[min(k, caps[m])] for m, c in kinds.items()) / n)
            seconds.append(step_s[width] + later[width] * owed / n)
        return tokens, seconds

    def _best_of(self, tokens: Sequence[float], step_s: Sequence[float]) -> int:
        """The k of the most tokens per second (ties: the smaller k), 0 unless it beats plain
        decoding by ``min_gain``."""
        rates = [t / s for t, s in zip(tokens, step_s)]
        best = max(range(self.max_k + 1), key=lambda k: (rates[k], -k))
        return best if rates[best] >= rates[0] * (1 + self.min_gain) else 0

    def _best_k_given(
        self, bucket: int, acceptance: Sequence[float] | None, row_depths: Sequence[int] | None = None
    ) -> int:
        """The argmax of expected tokens/s at ``bucket`` with conditional acceptances ``acceptance``
        (None: the estimates) for rows that keep ``row_depths`` (:meth:`_row_steps`), 0 unless it
        beats plain decoding by ``min_gain``."""
        return self._best_of(*self._row_steps(bucket, acceptance, row_depths))

    def best_k(self, bucket: int, row_depths: Sequence[int] | None = None, request: Hashable | None = None) -> int:
        """The k to draft at ``bucket`` now (no probing, nothing recorded), by the pool's estimates
        or ``request``'s (:meth:`acceptance`): where their best is 0, the best with every estimate
        at its upper bound; else the best with the next position, the one just past it, at its upper
        bound (module doc). ``row_depths``: the depths each row of the step keeps (0: it decodes
        plainly; None: every row every depth)."""
        estimates = self.acceptance(request)
        best = self._best_k_given(bucket, estimates, row_depths)
        if not self.confidence or best == self.max_k:
            return best
        bounds = self._bounds_of(estimates, self.confidence, request)
        if best == 0:
            return self._best_k_given(bucket, bounds, row_depths)
        estimates[best] = bounds[best]  # position best + 1
        return self._best_k_given(bucket, estimates, row_depths)

    def choose(
        self,
        bucket: int,
        row_depths: Sequence[int] | None = None,
        probe: bool = True,
        request: Hashable | None = None,
    ) -> int:
        """k for this engine step at ``bucket`` whose rows keep ``row_depths`` (:meth:`best_k`), or
        max_k on a probe step. ``probe=False``: no row could draft max_k (each keeps fewer depths,
        :meth:`depths_for`), so a probe that is due stays due. ``request``: the step's one drafting
        request, whose own estimates then choose (the engine names it at batch 1); None: the
        pool's."""
        best = self.best_k(bucket, row_depths, request)
        due = self._due(bucket, best) if self._probes(bucket) else math.inf  # scheduled before this step
        self.steps[bucket] += 1
        k = best
        if self.steps[bucket] >= due and probe:
            self.probes += 1
            k = self.max_k
            settled = (
                self._probe_best.get(bucket) == best
                and self.best_k_at(bucket, self.confidence, row_depths, request) == best
            )
            self._backoff[bucket] = min(self.max_backoff, self._backoff[bucket] + 1) if settled else 0
            self._probe_best[bucket] = best
            self._probe_step[bucket] = self.steps[bucket]
            self._next_probe[bucket] = self.steps[bucket] + self.probe_interval(bucket, best)
        self.chosen[k] += 1
        return k

    def plain_step(self, bucket: int) -> None:
        """Count a decode step at ``bucket`` that decoded plainly without a :meth:`choose` call (no
        request drafting), so probes stay due by decode steps, not by drafting rounds."""
        self.steps[bucket] += 1

    def steps_to_probe(self, bucket: int) -> float:
        """Steps at ``bucket`` until its next probe falls due (inf with probing off, or where no
        acceptance could make drafting pay)."""
        if not self._probes(bucket):
            return math.inf
        return self._due(bucket) - self.steps[bucket]

    def _probes(self, bucket: int) -> bool:
        """Whether ``bucket`` is probed at all: probing is on and a probe could change the choice
        (:meth:`drafting_could_pay`)."""
        return self.probe_every > 0 and self.drafting_could_pay(bucket)

    def _due(self, bucket: int, best: int | None = None) -> int:
        """The step from which ``bucket``'s next choose() probes (first asked since the start or
        since :meth:`set_costs`: one interval at the best k, ``best`` or computed only then)."""
        if bucket not in self._next_probe:
            interval = self.probe_interval(bucket, self.best_k(bucket) if best is None else best)
            self._next_probe[bucket] = self.steps[bucket] + interval
        return self._next_probe[bucket]

    def saving_per_token(self, bucket: int) -> float:
        """Seconds of a batch of ``bucket``'s time that each token a request emits at k saves over
        emitting it plainly, the request's share (one row) of ``step_s[0] / E(0) - step_s[k] /
        E(k)``, priced optimistically: every estimate at its upper bound, and k the best there.
        Whether a request drafts at all is decided like whether a round does (module doc): one
        admitted plainly observes nothing, so estimates priced low could never correct
        themselves (with the prior alone no request at batch 1 would draft). 0 where that k is 0."""
        return self._row_saving(bucket, self._optimistic(), self.lookahead)

    def _optimistic(self) -> list[float] | None:
        """The acceptances whether to draft is decided with: the upper bounds (None: the estimates,
        with ``confidence`` 0)."""
        return self.acceptance_bounds(self.confidence) if self.confidence else None

    def _row_saving(self, bucket: int, acceptance: Sequence[float] | None, depths: int) -> float:
        """Seconds of a batch of ``bucket``'s time that each token of a row kept to ``depths`` saves
        at its best k over emitting it plainly (one row's share, :meth:`_row_steps`; 0 where that
        k is 0), with conditional acceptances ``acceptance`` (None: the estimates)."""
        tokens, step_s = self._row_steps(bucket, acceptance, [depths])
        k = self._best_of(tokens, step_s)
        rows = self._measured_bucket(bucket) or bucket  # the batch the costs were measured at
        return max(0.0, step_s[0] / tokens[0] - step_s[k] / tokens[k]) / rows

    def drafting_pays_for(self, bucket: int, prompt_positions: int, new_tokens: int) -> bool:
        """Whether a request admitted into a batch of ``bucket`` with ``prompt_positions`` to draft
        over and up to ``new_tokens`` to emit earns back the drafter's pass over its prompt with
        some number of depths ``m``: ``new_tokens * saving(m) > prompt_positions * prompt_s * m /
        P`` (module doc), savings priced optimistically (:meth:`saving_per_token`, for a row kept
        to ``m`` depths) and the pass at the larger of the bucket's and batch 1's measured
        ``prompt_s``. Where the pass was not measured, whether the best k drafts at all."""
        prompt_s, P = self._prompt_price(bucket), self.lookahead
        if prompt_s <= 0.0 or P == 0:
            return self.best_k(bucket) != 0
        bounds = self._optimistic()
        pass_s = prompt_positions * prompt_s
        return any(new_tokens * self._row_saving(bucket, bounds, m) > pass_s * m / P for m in range(1, P + 1))

    def _prompt_price(self, bucket: int) -> float:
        """Seconds of the drafter's pass (every depth) per prompt position of a request admitted at
        ``bucket``: the larger of the bucket's and batch 1's measured ``prompt_s`` (0: none)."""
        measured = self._measured_bucket(bucket)
        # a prompt is mostly drafted over alone (continuous batching admits one request as another
        # finishes), at batch 1's price per position where that was measured: about twice batch 4's
        return 0.0 if measured is None else max(self.prompt_s.get(measured, 0.0), self.prompt_s.get(1, 0.0))

    def depths_for(self, bucket: int, prompt_positions: int, new_tokens: int, running: Collection[int] = ()) -> int:
        """How many of the drafter's P depths a request admitted to draft at ``bucket`` should
        keep, by the estimates: the ``m`` in 1..P of the largest ``new_tokens * saving(m) -
        prompt_positions * prompt_s * m / P`` (ties: the fewer). A request kept to ``m`` depths drafts
        at most ``m`` tokens a step, and its drafter passes over its prompt with ``m`` depths only,
        so that pass costs ``m / P`` of the whole one. ``saving(m)``: one row's share of ``step_s[0] /
        E(0) - cost_m(k) / E(min(k, m))`` at the best k for such a row (:meth:`_row_saving`), where
        a step at ``k < m`` still owes the catch-up of depths ``k .. m - 1`` and one at ``k >= m``
        owes none: the request has no deeper depths to catch up (module doc).
        ``running``: the depths that running requests draft with. Rows of another number of depths
        run a drafting round of their own, so an ``m`` among none of them costs the batch one more
        round per step for the request's ``new_tokens / E(m)`` steps, priced at ``step_s[1] -
        step_s[0]`` (a k = 1 step's round and its wider verify: at most what a round costs).
        The pool's estimates choose ``m``; then, as for a step's k (:meth:`best_k`), the choice is
        made again with position ``m + 1`` at its upper bound, which keeps more depths only where
        that position, priced optimistically, would pay for them: a request kept to ``m`` depths
        never observes it."""
        P, expected = self.lookahead, self.expected_tokens_all()
        step_s = self.step_costs(bucket)
        pass_s = prompt_positions * self._prompt_price(bucket)

        def value(m: int, acceptance: Sequence[float]) -> float:
            value = new_tokens * self._row_saving(bucket, acceptance, m) - pass_s * m / P
            if running and m not in running:  # one more drafting round per step while it runs
                value -= new_tokens / expected[min(m, self.max_k)] * (step_s[1] - step_s[0])
            return value

        def best(acceptance: Sequence[float]) -> int:
            return max(range(1, P + 1), key=lambda m: (value(m, acceptance), -m))

        estimates = self.acceptance()
        depths = best(estimates)
        if depths < P and self.confidence:  # the next position at its upper bound
            estimates[depths] = self._bounds_of(estimates, self.confidence, None)[depths]
            depths = best(estimates)
        return depths

    def note_admission(self, prompt_positions: int) -> None:
        """Record a request admitted to draft, whose drafter passes over ``prompt_positions``:
        what a probe's carrier passes over (:meth:`probe_interval`). Decayed like the estimates."""
        self._admitted.add(prompt_positions)

    def carrier_pass_s(self, bucket: int, best: int) -> float:
        """Seconds of ``bucket``'s time a probe's carrier spends on depths it keeps only for
        the probe: its drafter's pass over a prompt (the mean of those admitted to draft) with the
        depths beyond the ``best`` a request would otherwise keep (module doc). 0 before any
        admission or without a measured pass."""
        P, positions = self.lookahead, self._admitted.mean
        if positions is None or P == 0:
            return 0.0
        return positions * self._prompt_price(bucket) * (P - min(best, P)) / P

    def note_probe_steps(self, bucket: int, steps: float) -> None:
        """Record a probe as served at ``bucket``: the seconds of its drafting step and of the
        step that verified its drafts, in steps that did not probe (the engine's measure). Warm-up's
        step costs price a probe as one static step at max_k, but as served it also runs the
        depths its carrier deferred over every position since (an eager round): at batch 1,
        compiled, HumanEval, the two steps took 6.0 steps where the costs said 1 + 1.7.
        :meth:`probe_interval` takes the measure less one step (the verify that runs anyway)
        where that is larger; the pending probe is rescheduled from the previous one."""
        if not (math.isfinite(steps) and steps > 0):
            raise ValueError(f"a probe's steps must be a finite number > 0, got {steps}.")
        self._probe_steps.setdefault(bucket, DecayedMean(self.decay)).add(steps)
        if bucket in self._probe_step and bucket in self._next_probe:  # a probe since the costs (choose())
            best = self._probe_best[bucket]
            self._next_probe[bucket] = self._probe_step[bucket] + self.probe_interval(bucket, best)

    def measured_probe_steps(self, bucket: int) -> float | None:
        """The decayed mean of :meth:`note_probe_steps` at ``bucket`` (None: none measured)."""
        measured = self._probe_steps.get(bucket)
        return None if measured is None else measured.mean

    def probe_interval(self, bucket: int, best: int) -> int:
        """Steps from a probe at best k ``best`` to the next probe (module doc)."""
        # a probe's time beyond what steps at the best k would take for the tokens it is expected
        # to emit, in steps at the best k; at best k = 0 one request of the bucket drafts for it
        # (the engine admits the others plainly), so the probe emits E(max_k) for one row only.
        # Its carrier keeps every depth for it: the pass of the depths it would not keep otherwise
        expected = self.expected_tokens_all()
        step_s = self.costs_now(bucket)
        gain = expected[self.max_k] / expected[best] if best else 1 + (expected[self.max_k] - 1) / bucket
        own = step_s[self.max_k] / step_s[best]  # the probe step, in steps at the best k
        measured = self.measured_probe_steps(bucket)
        if measured is not None:  # its drafting step and the verify after it, as served, less one step
            own = max(own, measured - 1.0)
        extra = own + self.carrier_pass_s(bucket, best) / step_s[best] - gain
        paid = math.ceil(extra / self.probe_budget) if self.probe_budget > 0 and extra > 0 else 0
        return max(self.probe_every, paid) << self._backoff[bucket]

    def predicted_speedup(self, bucket: int, k: int) -> float:
        """Predicted tokens/s at k over plain decoding: ``(E(k) / step_s[k]) / (1 / step_s[0])``
        (step costs with catch-ups, :meth:`costs_now`)."""
        step_s = self.costs_now(bucket)
        return self.expected_tokens(k) / step_s[k] * step_s[0]

    def summary(self) -> dict[str, Any]:
        """Plain JSON-able dict for the metrics (dict keys are strings)."""
        return {
            "max_k": self.max_k,
            "acceptance": self.acceptance(),
            "expected_tokens": self.expected_tokens_all(),
            "chosen": {str(k): n for k, n in sorted(self.chosen.items())},
            "probes": self.probes,
            "probe_every": self.probe_every,
            "probe_budget": self.probe_budget,
            "probe_steps": {str(b): self.measured_probe_steps(b) for b in sorted(self._probe_steps)},
            "acceptance_bounds": self.acceptance_bounds(self.confidence),
            "costs": {str(b): list(c) for b, c in sorted(self.costs.items())},
            "catch_up_s": {str(b): list(c) for b, c in sorted(self.catch_up.items())},
            "prompt_s": {str(b): s for b, s in sorted(self.prompt_s.items())},
            "costs_now": {str(b): self.costs_now(b) for b in sorted(self.costs)},
            "best_k": {str(b): self.best_k(b) for b in sorted(self.costs)},
            "drafting_could_pay": {str(b): self.drafting_could_pay(b) for b in sorted(self.costs)},  # else no probes
        }
