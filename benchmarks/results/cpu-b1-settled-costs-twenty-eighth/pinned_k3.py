"""The `auto` engine pinned to k = 3 with 3 depths a request, against fixed k = 3 (benchmarks/history.md,
"Twenty-eighth session").

An ad hoc research script, kept with its results as the record of how they were made; it is not
maintained with the package. Run from the repository root with the project's venv:

    python benchmarks/results/cpu-b1-settled-costs-twenty-eighth/pinned_k3.py HUMANEVAL_PROMPTS [PROFILE]

Builds, as scripts/bench.py does (compiled, batch 1, 1 thread), fixed k = 3 and `auto` engines; the
`auto` engine's choice is pinned to k = 3 (no probes) and every request keeps 3 depths. Serves the
first HUMANEVAL_PROMPTS HumanEval prompts with both in turn (order alternating per prompt), 64 new
tokens, EOS ignored, and prints tokens/s, step-time split (verify, draft, bookkeeping, forwards)
and, with PROFILE, the functions whose own time differs most between the two (cProfile).
"""
import cProfile, pstats, sys

from inkfw.speculative.engine import StepTimes

import harness

H = int(sys.argv[1])
profile = len(sys.argv) > 2
setup = harness.setup("[auto]")
sets = setup.sets
cases = {name: harness.build(setup, k, name) for name, k in [("k3", 3), ("auto3", "auto")]}
auto = cases["auto3"].engine
auto.adaptive.choose = lambda *args, **kwargs: 3
auto._admission_depths = lambda r, num_rows: 3
for c in cases.values():
    c.engine.times = StepTimes()
profiles = {n: cProfile.Profile() for n in cases}
wall = harness.serve_in_turn({n: c.engine for n, c in cases.items()}, sets["humaneval"][:H],
                             around=(lambda n: profiles[n]) if profile else None)
for n, c in cases.items():
    t = c.engine.times
    print(n, f"tokens/s {64 * H / wall[n]:.1f}", f"steps {t.num_steps}", f"verify {t.verify_s:.3f}", f"draft {t.draft_s:.3f}",
          f"bookkeeping {t.bookkeeping_s:.3f}", f"forward {t.forward_s:.3f}", f"prompt {t.prompt_s:.3f}")
if profile:
    own = {}
    for n, pr in profiles.items():
        st = pstats.Stats(pr)
        own[n] = {f"{f[0].split('/')[-1]}:{f[1]}:{f[2]}": v[2] for f, v in st.stats.items()}
    keys = set(own["k3"]) | set(own["auto3"])
    diff = sorted(keys, key=lambda f: own["auto3"].get(f, 0) - own["k3"].get(f, 0), reverse=True)
    print("own time, s: auto3 - k3 (top 25)")
    for f in diff[:25]:
        print(f"{own['auto3'].get(f, 0) - own['k3'].get(f, 0):+.3f}  auto3 {own['auto3'].get(f, 0):.3f}  k3 {own['k3'].get(f, 0):.3f}  {f}")
