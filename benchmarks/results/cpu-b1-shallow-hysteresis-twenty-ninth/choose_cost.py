"""Host time of one AdaptiveK.choose and observe call at batch 1 (benchmarks/history.md, "Twenty-ninth
session"). An ad hoc script, not maintained with the package: python choose_cost.py

Its output on the shared 2-core machine (2026-12-06): choose 43.7 us, observe 1.6 us per call."""
import random
import time

from inkfw.speculative.adaptive import AdaptiveK

a = AdaptiveK(8, 8)
a.set_costs(1, [3.7e-3 + 0.8e-3 * k + (0.9e-3 if k else 0) for k in range(9)], [2e-4] * 9, 1.3e-4)
for _ in range(200):
    a.observe([3], [random.randint(0, 3)], ["r"])
N = 2000
t = time.perf_counter()
for _ in range(N):
    a.choose(1, [5], True, "r")
print("choose us", (time.perf_counter() - t) / N * 1e6)
t = time.perf_counter()
for _ in range(N):
    a.observe([3], [2], ["r"])
print("observe us", (time.perf_counter() - t) / N * 1e6)
