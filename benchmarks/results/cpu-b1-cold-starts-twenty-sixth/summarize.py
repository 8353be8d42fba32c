"""The twenty-sixth session's cold-start table from these logs: python summarize.py process-A.log"""

import json
import statistics
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
for set_name in ("stdlib-heldout", "humaneval"):
    for variant in sorted({r["variant"] for r in rows}):
        runs = [r for r in rows if r["set"] == set_name and r["variant"] == variant]
        vs_best = [min(r["walls"]["k2"], r["walls"]["k3"]) / r["walls"][r["engine"]] for r in runs]
        rounds = sum(sum(r["chosen"].values()) for r in runs)
        at_1 = sum(r["chosen"].get("1", 0) for r in runs)
        print(
            f"{set_name:15} {variant:18} cold starts {len(runs):3}  vs best {statistics.mean(vs_best):.3f}"
            f" (min {min(vs_best):.3f})  share of rounds at k = 1 {at_1 / rounds:.2f}"
        )
