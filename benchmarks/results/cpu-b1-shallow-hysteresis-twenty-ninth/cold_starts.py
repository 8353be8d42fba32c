"""Cold starts of `spec.num_tokens=auto` (benchmarks/history.md, "Twenty-ninth session"): the twenty-eighth
session's served_scale.py with its own patches left out (inert in processes P-R, which named none of
them; so was its step-timing hook) and four new ones:

- pool_bounds=1: a lone request's next position judged at its upper bound with the pool's width
  (its weight in requests plus the prior's), not the request's own (process P);
- next_optimism=0: neither a step's k nor a request's depths chosen again with the next position at
  its upper bound (whether to draft at all still is); k_optimism=0: the same for a step's k alone;
- noflap=1: a lone request kept to m < P depths drafts a shallow k < m only where that beats k = m
  by min_gain by its own estimates (noflap.patch: the same rule in the package, tried and not kept).

An ad hoc research script, kept with its results as the record of how they were made; it is not
maintained with the package. Run from the repository root with the project's venv (processes P-R
ran at 9251cfd; process P with an earlier copy that lacked the last three patches):

    python benchmarks/results/cpu-b1-shallow-hysteresis-twenty-ninth/cold_starts.py TRIALS HUMANEVAL_PROMPTS VARIANTS

Engines, trials and output as in the twenty-seventh session's cold_starts.py (4 auto engines,
variants rotated over them per trial; one JSON line per trial, set and auto engine with every
engine's wall; ratio = k = 2's wall / the engine's).
"""
import copy
import os
import sys

sys.path.insert(0, "benchmarks/results/cpu-b1-settled-costs-twenty-eighth")
import harness  # noqa: E402

from inkfw.speculative.adaptive import AdaptiveK  # noqa: E402

_bounds_of, _best_k, _depths_for = AdaptiveK._bounds_of, AdaptiveK.best_k, AdaptiveK.depths_for


def bounds_of(self, estimates, confidence, request):
    # pool_bounds=1: a request's estimates get the pool's width (its weight in requests plus the
    # prior's), not the request's own (its observations plus request_weight)
    return _bounds_of(self, estimates, confidence, None if getattr(self, "pool_bounds", 0.0) else request)


def best_k(self, bucket, row_depths=None, request=None):
    if getattr(self, "next_optimism", 1.0) and getattr(self, "k_optimism", 1.0):
        best = _best_k(self, bucket, row_depths, request)
    else:  # the estimates' best where it drafts; where it is 0, HEAD's choice with every estimate at its bound
        estimates = self.acceptance(request)
        best = self._best_k_given(bucket, estimates, row_depths)
        if not best and self.confidence:
            best = self._best_k_given(bucket, self._bounds_of(estimates, self.confidence, request), row_depths)
    # noflap=1: a lone request kept to m < P depths drafts fewer than m (a shallow round, whose
    # deferred depths catch up in an eager round later) only where that beats k = m by min_gain
    m = row_depths[0] if row_depths and len(row_depths) == 1 else 0
    if getattr(self, "noflap", 0.0) and request is not None and 0 < best < m < self.lookahead:
        tokens, secs = self._row_steps(bucket, self.acceptance(request), row_depths)
        return best if tokens[best] / secs[best] >= (1 + self.min_gain) * tokens[m] / secs[m] else m
    return best


def depths_for(self, *args, **kwargs):
    if getattr(self, "next_optimism", 1.0):
        return _depths_for(self, *args, **kwargs)
    saved, self.confidence = self.confidence, 0.0  # the pool's estimates alone
    try:
        return _depths_for(self, *args, **kwargs)
    finally:
        self.confidence = saved


AdaptiveK._bounds_of, AdaptiveK.best_k, AdaptiveK.depths_for = bounds_of, best_k, depths_for

trials, humaneval = int(sys.argv[1]), int(sys.argv[2])
variants = sys.argv[3].split(",")  # auto engine i runs variants[(i + trial) % len(variants)]
setup = harness.setup("[2,3,auto]")
engines = {name: harness.build(setup, k, name).engine for name, k in
           [("k2", 2), ("k3", 3), ("k2b", 2)] + [(f"a{i}", "auto") for i in range(int(os.environ.get("NA", "4")))]}
warm = harness.warm_states(engines)  # each trial starts from these
given = {}  # auto engine -> its variant this trial


def with_variant(ad, variant):
    for setting in variant.split("+"):
        if setting != "head":
            name, value = setting.split("=")
            setattr(ad, name, int(value) if isinstance(getattr(ad, name, 0.0), int) else float(value))
    return ad


def start(t):
    for i, (a, ad) in enumerate(warm.items()):  # auto engine i runs variants[(i + t) % len(variants)]
        given[a] = variants[(i + t) % len(variants)]
        engines[a].adaptive = with_variant(copy.deepcopy(ad), given[a])


def line(t, set_name, a, wall, chosen):
    return dict(trial=t, set=set_name, engine=a, variant=given[a], ratio=wall["k2"] / wall[a], k3=wall["k2"] / wall["k3"],
                k2b=wall["k2"] / wall["k2b"], walls={n: round(w, 3) for n, w in wall.items()}, chosen=dict(sorted(chosen.items())))


harness.cold_start_trials(setup, engines, trials, humaneval, start, line, "/tmp/cold_starts.json")
