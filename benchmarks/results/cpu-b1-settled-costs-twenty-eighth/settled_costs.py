"""Warm-up timing the second against the fourth step at each k, side by side (benchmarks/history.md,
"Twenty-eighth session").

An ad hoc research script, kept with its results as the record of how they were made; it is not
maintained with the package. Run from the repository root with the project's venv:

    python benchmarks/results/cpu-b1-settled-costs-twenty-eighth/settled_costs.py TRIALS HUMANEVAL_PROMPTS [STEPS...]

It builds engines as scripts/bench.py does, around one shared model (compiled, batch 1, 1 thread):
fixed k = 2, fixed k = 3, and one `auto` engine per STEPS value (default: 2 4 2 4), warmed up as
the bench warms it but with ``Engine.warmup(cost_steps=STEPS)``: the step timed at each k is the
STEPS-th after the change (HEAD: 2). ``cost_steps`` is not in the package: apply ``cost_steps.patch``
(this folder; tried and not kept) with ``git apply`` first. It saves each auto engine's AdaptiveK,
then runs TRIALS trials: each restores every auto engine's saved AdaptiveK (a cold start) and
serves the 12 stdlib-heldout prompts, then the first HUMANEVAL_PROMPTS HumanEval prompts, every
engine decoding each prompt in turn (order alternating per prompt), 64 new tokens, EOS ignored.
One JSON line per (trial, set, auto engine): walls of every engine; ratio = the best fixed k's
wall / the engine's.
"""
import copy, sys

from inkfw.speculative.engine import Engine

import harness

T, H = int(sys.argv[1]), int(sys.argv[2])
steps = [int(s) for s in sys.argv[3:]] or [2, 4, 2, 4]
setup = harness.setup("[2,3,auto]")
print("max_model_len", setup.max_model_len, flush=True)

inner = Engine.warmup.__wrapped__
defaults = inner.__defaults__
specs = [("k2", 2, None), ("k3", 3, None)] + [(f"a{i}s{s}", "auto", s) for i, s in enumerate(steps)]
cases = {}
for name, k, s in specs:
    inner.__defaults__ = defaults[:-1] + (s or defaults[-1],)
    cases[name] = harness.build(setup, k, name)
inner.__defaults__ = defaults
engines = {n: c.engine for n, c in cases.items()}
warm = harness.warm_states(engines)


def start(t):
    for a, ad in warm.items():
        engines[a].adaptive = copy.deepcopy(ad)


def line(t, set_name, a, wall, chosen):
    return dict(trial=t, set=set_name, engine=a, ratio=min(wall["k2"], wall["k3"]) / wall[a], k3_vs_k2=wall["k2"] / wall["k3"],
                walls={n: round(w, 3) for n, w in wall.items()}, chosen=dict(sorted(chosen.items())))


harness.cold_start_trials(setup, engines, T, H, start, line, "/tmp/s28/settled.json")
