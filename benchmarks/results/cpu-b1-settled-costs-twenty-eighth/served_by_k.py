"""Served decode steps by k, against warm-up's costs (benchmarks/history.md, "Twenty-eighth session").

An ad hoc research script, kept with its results as the record of how they were made; it is not
maintained with the package. Run from the repository root with the project's venv:

    python benchmarks/results/cpu-b1-settled-costs-twenty-eighth/served_by_k.py HUMANEVAL_PROMPTS [FIXED_K...]

Builds, as scripts/bench.py does (compiled, batch 1, 1 thread), one `auto` engine and fixed-k
engines (default k = 2..6), serves the first HUMANEVAL_PROMPTS HumanEval prompts with every
engine in turn (order alternating per prompt), 64 new tokens, EOS ignored, and times every engine
step. A step is *steady* when it prefilled nothing, took no part in a probe, and drafted the k
the step before it drafted (so it verified k drafts and drafted k). Prints, per k, the median
steady step of the auto engine and of the fixed engine at that k, against the auto engine's
warm-up cost (``costs_now``), and each engine's tokens/s.
"""
import sys, statistics
from collections import defaultdict


import harness

H = int(sys.argv[1])
fixed = [int(k) for k in sys.argv[2:]] or [2, 3, 4, 5, 6]
setup = harness.setup("[auto]")
sets = setup.sets

steps = defaultdict(lambda: defaultdict(list))  # engine -> k -> steady step seconds
by_depths = defaultdict(list)  # (k, depths the request keeps) -> the auto engine's steady step seconds


def recorder(name, engine):
    def on_step(step):
        if step["steady"]:
            steps[name][step["k"]].append(step["seconds"])
            if engine.adaptive is not None and len(engine.running) == 1:  # by the depths the request keeps
                by_depths[(step["k"], engine._depths_kept(engine.running[0]))].append(step["seconds"])

    return on_step


specs = [("auto", "auto")] + [(f"k{k}", k) for k in fixed]
cases = {}
for name, k in specs:
    cases[name] = harness.build(setup, k, name)
    harness.time_steps(cases[name].engine, recorder(name, cases[name].engine))
ad = cases["auto"].engine.adaptive
warm = ad.costs_now(1)
print("warm-up costs_now ms", [round(x * 1e3, 2) for x in warm], flush=True)

wall = harness.serve_in_turn({n: c.engine for n, c in cases.items()}, sets["humaneval"][:H])
tokens = 64 * H
print("tokens/s", {n: round(tokens / w, 1) for n, w in wall.items()})
print("chosen", dict(sorted(ad.chosen.items())))
print("k | warm-up ms | auto steady median (n) | fixed steady median (n)")
for k in range(ad.max_k + 1):
    a = steps["auto"].get(k, [])
    f = steps[f"k{k}"].get(k, []) if f"k{k}" in steps else []
    med = lambda xs: f"{statistics.median(xs) * 1e3:.2f} ({len(xs)})" if xs else "-"
    print(k, "|", round(warm[k] * 1e3, 2), "|", med(a), "|", med(f))
print("auto steady steps by (k, depths kept): median ms (n)")
for (k, m), xs in sorted(by_depths.items()):
    print(k, m, f"{statistics.median(xs) * 1e3:.2f} ({len(xs)})")
print("depths admitted", dict(cases["auto"].engine.depths_admitted))
