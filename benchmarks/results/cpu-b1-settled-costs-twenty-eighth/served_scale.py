"""Cold starts of `spec.num_tokens=auto` with step costs scaled to served steps (benchmarks/history.md,
"Twenty-eighth session"; the twenty-seventh session's cold_starts.py with its old patches left out
and one new patch, served_scale).

An ad hoc research script, kept with its results as the record of how they were made; it is not
maintained with the package. Run from the repository root with the project's venv:

    python benchmarks/results/cpu-b1-settled-costs-twenty-eighth/served_scale.py TRIALS HUMANEVAL_PROMPTS VARIANTS

Engines, trials and output as in the twenty-seventh session's script (ratio = k = 2's wall / the
engine's; k3 = k = 2's wall / k = 3's). VARIANTS, comma-separated, each "head" or
ATTR=VALUE[+ATTR=VALUE] set on the restored AdaptiveK copy. The patch: with ``served_scale=1``
every warm-up step cost of a bucket is multiplied by one factor learned from served steps, the
decayed geometric mean (0.98 a sample, a prior of 8 samples at 1) of served/warm-up over *steady*
decode steps (no prefill, no probe in it or the step before, the same k as the step before, k
forced by nothing). A uniform factor leaves every ratio between k, and so every choice of k, as
it was; it changes what compares step seconds with other seconds: a request's depths and
admission (savings per token against the prompt pass) and probe spacing (a carrier's pass
against steps). A second patch, for process M: ``depths_optimism=0`` chooses a request's depths by
the pool's estimates alone (HEAD chooses again with position m + 1 at its upper bound). A third,
for process N: ``served_pass=1`` prices the drafter's pass over a prompt (admission, depths,
carriers) at warm-up's ``prompt_s`` times the decayed geometric mean (0.9 a sample, a prior of 2
at 1) of served over warm-up passes: the drafting seconds of a batch-1 prompt step over what
warm-up's price gives for its prompt and the depths the request keeps.
"""
import copy, sys, os, math


import harness

T, H = int(sys.argv[1]), int(sys.argv[2])
variants = sys.argv[3].split(",")  # auto engine i runs variants[(i + trial) % len(variants)]
NA = int(os.environ.get("NA", "4"))
setup = harness.setup("[2,3,auto]")
from inkfw.speculative.adaptive import AdaptiveK
from inkfw.speculative.engine import bucket_for

_step_costs = AdaptiveK.step_costs


def step_costs(self, bucket):
    costs = _step_costs(self, bucket)
    if not getattr(self, "served_scale", 0.0):
        return costs
    scale = self.__dict__.get("_scale", {}).get(self._measured_bucket(bucket))
    return costs if scale is None else [c * math.exp(scale[0] / scale[1]) for c in costs]


def note_served(self, bucket, k, seconds):
    warm = _step_costs(self, bucket)[k]
    key = self._measured_bucket(bucket)
    total, weight = self.__dict__.setdefault("_scale", {}).get(key, (0.0, 8.0))
    r = max(-math.log(2), min(math.log(2), math.log(seconds / warm)))
    self._scale[key] = (0.98 * total + r, 0.98 * weight + 1.0)


AdaptiveK.step_costs = step_costs

_depths_for = AdaptiveK.depths_for


def depths_for(self, *args, **kwargs):
    # depths_optimism=0 (process M): a request's depths by the pool's estimates alone, without
    # HEAD's second choice with position m + 1 at its upper bound
    if getattr(self, "depths_optimism", 1.0):
        return _depths_for(self, *args, **kwargs)
    saved, self.confidence = self.confidence, 0.0
    try:
        return _depths_for(self, *args, **kwargs)
    finally:
        self.confidence = saved


AdaptiveK.depths_for = depths_for

_prompt_price = AdaptiveK._prompt_price


def prompt_price(self, bucket):
    # served_pass=1 (process N): warm-up's price of the prompt pass times the decayed geometric
    # mean of served over warm-up passes (note_pass)
    price = _prompt_price(self, bucket)
    scale = self.__dict__.get("_pass_scale") if getattr(self, "served_pass", 0.0) else None
    return price if scale is None else price * math.exp(scale[0] / scale[1])


def note_pass(self, seconds, positions, depths):
    warm = _prompt_price(self, 1) * positions * depths / self.lookahead
    if warm <= 0:
        return
    total, weight = self.__dict__.get("_pass_scale", (0.0, 2.0))
    r = max(-math.log(4), min(math.log(4), math.log(seconds / warm)))
    self._pass_scale = (0.9 * total + r, 0.9 * weight + 1.0)


AdaptiveK._prompt_price = prompt_price


def hook(engine):
    def on_step(step):
        ad = engine.adaptive
        if ad is None or engine._forced_k is not None:
            return
        if step["prompt"] and len(engine.running) == 1 and getattr(ad, "served_pass", 0.0):
            r = engine.running[0]  # batch 1: the step passed over this request's prompt alone
            depths = engine._depths_kept(r) if not r.drafting_off else 0
            if depths:
                note_pass(ad, step["draft_s"], len(r.prompt_token_ids), min(depths, ad.lookahead))
        if step["steady"] and step["rows"] and getattr(ad, "served_scale", 0.0):
            note_served(ad, bucket_for(step["rows"], engine.config.batch_buckets), step["k"], step["seconds"])

    harness.time_steps(engine, on_step)


specs = [("k2", 2), ("k3", 3), ("k2b", 2)] + [(f"a{i}", "auto") for i in range(NA)]
cases = {}
for name, k in specs:
    cases[name] = harness.build(setup, k, name)
    if cases[name].engine.adaptive is not None:
        hook(cases[name].engine)
engines = {n: c.engine for n, c in cases.items()}
warm = harness.warm_states(engines)


def apply(ad, variant):
    for kv in variant.split("+"):
        if kv == "head": continue
        k, v = kv.split("=")
        setattr(ad, k, float(v) if not isinstance(getattr(ad, k, 0.0), int) else int(v))
        if k == "prior_weight": ad._could_pay = {}


def learned(scale):
    """A (decayed log total, weight) factor as a number (1 where nothing was learned)."""
    total, weight = scale or (0.0, 1.0)
    return round(math.exp(total / weight), 3)


given = {}  # auto engine -> its variant this trial


def start(t):
    for i, (a, ad) in enumerate(warm.items()):  # auto engine i runs variants[(i + t) % len(variants)]
        given[a] = variants[(i + t) % len(variants)]
        engines[a].adaptive = copy.deepcopy(ad)
        apply(engines[a].adaptive, given[a])


def line(t, set_name, a, wall, chosen):
    ad = engines[a].adaptive
    return dict(trial=t, set=set_name, engine=a, variant=given[a],
                ratio=wall["k2"] / wall[a], k3=wall["k2"] / wall["k3"], k2b=wall["k2"] / wall["k2b"],
                walls={n: round(w, 3) for n, w in wall.items()}, chosen=dict(sorted(chosen.items())),
                pass_scale=learned(ad.__dict__.get("_pass_scale")), scale=learned(ad.__dict__.get("_scale", {}).get(1)))


harness.cold_start_trials(setup, engines, T, H, start, line, "/tmp/s28/cold.json")
