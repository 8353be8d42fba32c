"""Warm-up timing the second against the fourth step at each k, side by side (BENCHMARKS.md,
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
import copy, sys, os, json
from collections import Counter

from inkfw.bench.run import _generate
from inkfw.speculative.engine import Engine

import harness

T, H = int(sys.argv[1]), int(sys.argv[2])
steps = [int(s) for s in sys.argv[3:]] or [2, 4, 2, 4]
setup = harness.setup("[2,3,auto]")
sets = setup.sets
print("max_model_len", setup.max_model_len, flush=True)

inner = Engine.warmup.__wrapped__
defaults = inner.__defaults__
specs = [("k2", 2, None), ("k3", 3, None)] + [(f"a{i}s{s}", "auto", s) for i, s in enumerate(steps)]
cases = {}
for name, k, s in specs:
    inner.__defaults__ = defaults[:-1] + (s or defaults[-1],)
    cases[name] = harness.build(setup, k, name)
inner.__defaults__ = defaults
snap = {n: copy.deepcopy(c.engine.adaptive) for n, c in cases.items() if c.engine.adaptive is not None}
for n, ad in snap.items():
    print(n, "costs_ms", [round(x * 1e3, 2) for x in ad.costs_now(1)], "acc", [round(x, 2) for x in ad.acceptance()],
          "best", ad.best_k(1), "prompt_s", ad.prompt_s, flush=True)

autos = [n for n, _, s in specs if s]
names = [n for n, _, _ in specs]
results = []
for t in range(T):
    for a in autos:
        cases[a].engine.adaptive = copy.deepcopy(snap[a])
    for setname, prompts in [("stdlib-heldout", sets["stdlib-heldout"]), ("humaneval", sets["humaneval"][:H])][: 2 if H else 1]:
        wall = Counter()
        ch = {a: Counter(cases[a].engine.adaptive.chosen) for a in autos}
        for j, p in enumerate(prompts):
            order = names if (j + t) % 2 == 0 else names[::-1]
            for n in order:
                w, _ = _generate(cases[n].engine, [p], 64, n)
                wall[n] += w
        best = min(wall["k2"], wall["k3"])
        for a in autos:
            chosen = Counter(cases[a].engine.adaptive.chosen) - ch[a]
            r = dict(trial=t, set=setname, engine=a, ratio=best / wall[a], k3_vs_k2=wall["k2"] / wall["k3"],
                     walls={n: round(w, 3) for n, w in wall.items()}, chosen=dict(sorted(chosen.items())))
            results.append(r)
            print(json.dumps(r), flush=True)
json.dump(results, open(os.environ.get("OUT", "/tmp/s28/settled.json"), "w"))
