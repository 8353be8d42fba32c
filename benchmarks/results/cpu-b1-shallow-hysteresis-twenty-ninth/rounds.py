"""Drafting rounds of fixed k = 3 and `auto`, by kind (benchmarks/history.md, "Twenty-ninth session").

An ad hoc research script, not maintained with the package. Run from the repository root:

    python benchmarks/results/cpu-b1-shallow-hysteresis-twenty-ninth/rounds.py HUMANEVAL_PROMPTS

Builds compiled batch-1 engines as scripts/bench.py does (fixed k = 3 and auto), serves the first
HUMANEVAL_PROMPTS HumanEval prompts with both in turn (64 new tokens, EOS ignored), and times every
`MtpDrafter.propose` call by kind: a prompt round (by the depths its request keeps), a catch-up (a
row's deferred depths ran), a shallow round (a row defers depths), or a full round; then lists the
catch-ups as (deferred positions, ms, k).
"""
import statistics, sys, time
from collections import defaultdict
sys.path.insert(0, "benchmarks/results/cpu-b1-settled-costs-twenty-eighth")
import harness
H = int(sys.argv[1])
s = harness.setup("[3,auto]")
cases = {n: harness.build(s, k, n) for n, k in [("k3", 3), ("auto", "auto")]}
caught = []
stats = {n: defaultdict(lambda: [0, 0.0]) for n in cases}
for n, c in cases.items():
    d = c.engine.drafter
    orig = d.propose
    def wrapped(spans, kv, run=None, keep_logits=False, pad_to=None, num_tokens=None, _o=orig, _d=d, _n=n):
        before = [getattr(_d._rows.get(sp.request.id), "deferred", None) for sp in spans]
        lv = [None if b is None else b.level for b in before]  # the level before the round (it may change in place)
        t = time.perf_counter()
        out = _o(spans, kv, run, keep_logits=keep_logits, pad_to=pad_to, num_tokens=num_tokens)
        dt = time.perf_counter() - t
        after = [_d._rows.get(sp.request.id).deferred for sp in spans]
        K = num_tokens
        if any(sp.num_accepted is None for sp in spans):
            cat = f"prompt depths={spans[0].depths}"
        elif any(b is not None and (a is None or a.level != l) for b, a, l in zip(before, after, lv)):
            cat = "catch-up"
            caught.append((max(sp.start - b.first for sp, b in zip(spans, before) if b is not None), round(dt*1e3, 2), num_tokens))
        elif any(a is not None for a in after):
            cat = f"shallow k={K}"
        else:
            cat = f"full k={K} depths={spans[0].depths}"
        st = stats[_n][cat]; st[0] += 1; st[1] += dt
        return out
    d.propose = wrapped
wall = harness.serve_in_turn({n: c.engine for n, c in cases.items()}, s.sets["humaneval"][:H])
for n in cases:
    print(f"== {n} wall {wall[n]:.2f}")
    for cat, (cnt, sec) in sorted(stats[n].items(), key=lambda x: -x[1][1]):
        print(f"  {cat:28s} {cnt:5d} rounds {sec:7.3f} s  {1000*sec/cnt:6.2f} ms/round")
ad = cases["auto"].engine.adaptive
print("catch_up", ad.catch_up, "costs", [round(c*1e3,2) for c in ad.costs[1]], "prompt_s", ad.prompt_s)
print("caught", caught[:80])
if caught: print("catch-up positions median", statistics.median(c[0] for c in caught), "ms median", statistics.median(c[1] for c in caught))
