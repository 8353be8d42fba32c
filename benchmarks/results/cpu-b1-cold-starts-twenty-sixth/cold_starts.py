"""Cold starts of `spec.num_tokens=auto`, many per process (benchmarks/history.md, "Twenty-sixth session").

An ad hoc research script, kept with its results as the record of how they were made; it is not
maintained with the package. Run from the repository root with the project's venv:

    python benchmarks/results/cpu-b1-cold-starts-twenty-sixth/cold_starts.py TRIALS HUMANEVAL_PROMPTS VARIANTS

It builds engines as scripts/bench.py does, around one shared model (compiled, batch 1, 1 thread):
fixed k = 2, fixed k = 3, a second fixed k = 2 (a control) and NA (default 4) auto engines, each
warmed up as the bench warms it (Engine.warmup, then 8 tokens of each prompt set's first prompt).
It saves each auto engine's AdaptiveK, then runs TRIALS trials: each restores every auto engine's
saved AdaptiveK, gives it a variant (rotated over the engines from trial to trial), and serves the
12 stdlib-heldout prompts, then the first HUMANEVAL_PROMPTS HumanEval prompts, every engine
decoding each prompt in turn (order alternating per prompt), 64 new tokens, EOS ignored. One JSON
line per (trial, set, auto engine): walls of every engine, ratio = k = 2's wall / the engine's.

VARIANTS, comma-separated, each "head" or ATTR=VALUE[+ATTR=VALUE]: an AdaptiveK attribute set on
the restored copy (prior_weight, probe_budget, ...), or one of this script's patches: margin (the
smallest k whose rate is within that fraction of the best k's) and ucb (upper bounds at that
confidence for the k of every step and the depths a request keeps), and unsettled_budget (the probe
budget while the optimistic best k differs from the estimates' best; probe_budget otherwise).
"""
import copy, sys, time, os, json
from pathlib import Path
import inkfw
from collections import Counter
import torch
from hydra import compose, initialize_config_dir
from inkfw.bench.run import _build_case, _generate, shared_max_model_len
from inkfw.bench.plan import BenchRun
from inkfw.bench.prompt_sets import load_prompt_set
from inkfw.speculative.factory import load_tokenizer
from inkfw.bench import run as R

T, H = int(sys.argv[1]), int(sys.argv[2])
variants = sys.argv[3].split(",")  # auto engine i runs variants[(i + trial) % len(variants)]
NA = int(os.environ.get("NA", "4"))
torch.set_num_threads(1)
with initialize_config_dir(config_dir=str(Path(inkfw.__file__).resolve().parent / "conf"), version_base=None):
    cfg = compose("bench", overrides=["modes=[compiled]", "batch_sizes=[1]", "num_tokens=[2,3,auto]", "hf=[]", "forward_ops=[]"])
tok = load_tokenizer(cfg.model)
mcfg = R.model_config(cfg.model)
sets = {n: load_prompt_set(n, tok, 164, mcfg.logits_vocab_size, 32, 0) for n in ["stdlib-heldout", "humaneval"]}
model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)
specs = [("k2", 2), ("k3", 3), ("k2b", 2)] + [(f"a{i}", "auto") for i in range(NA)]
cases = {}
for name, k in specs:
    t0 = time.time()
    c = _build_case(cfg, BenchRun("inkfw", "compiled", "mtp", k, 1), model, tok, mml, True)
    for prompts in sets.values():
        _generate(c.engine, [prompts[0]], 8, name)
    cases[name] = c
    print(f"built {name} {time.time()-t0:.0f}s", flush=True)
snap = {n: copy.deepcopy(c.engine.adaptive) for n, c in cases.items() if c.engine.adaptive is not None}
for n, ad in snap.items():
    print(n, "costs_ms", [round(x*1e3, 2) for x in ad.costs_now(1)], "acc", [round(x, 2) for x in ad.acceptance()], "best", ad.best_k(1), "prompt_s", ad.prompt_s, flush=True)

from inkfw.speculative.adaptive import AdaptiveK
def _best_of(self, tokens, step_s):
    rates = [t / s for t, s in zip(tokens, step_s)]
    best = max(range(self.max_k + 1), key=lambda k: (rates[k], -k))
    m = getattr(self, "margin", 0.0)
    if m:
        best = min(k for k in range(1, best + 1) if rates[k] * (1 + m) >= rates[best]) if best else 0
    return best if rates[best] >= rates[0] * (1 + self.min_gain) else 0
AdaptiveK._best_of = _best_of
import inspect, textwrap, inkfw.speculative.adaptive as AM
_orig_best_k = AdaptiveK.best_k
def best_k(self, bucket, row_depths=None):
    u = getattr(self, "ucb", 0.0)
    if not u:
        return _orig_best_k(self, bucket, row_depths)
    return self.best_k_at(bucket, u, row_depths) or self.best_k_at(bucket, self.confidence, row_depths)
AdaptiveK.best_k = best_k
src = textwrap.dedent(inspect.getsource(AdaptiveK.depths_for))
assert "self._row_saving(bucket, None, m)" in src
src = src.replace("self._row_saving(bucket, None, m)", "self._row_saving(bucket, self.acceptance_bounds(self.ucb) if getattr(self, 'ucb', 0.0) else None, m)")
ns = {}
exec(src, AM.__dict__, ns)
AdaptiveK.depths_for = ns["depths_for"]
_orig_interval = AdaptiveK.probe_interval
def probe_interval(self, bucket, best):
    # unsettled_budget: the probe budget while the optimistic best differs from ``best``
    u = getattr(self, "unsettled_budget", 0.0)
    if not u or self.best_k_at(bucket, self.confidence) == best:
        return _orig_interval(self, bucket, best)
    saved, self.probe_budget = self.probe_budget, u
    try:
        return _orig_interval(self, bucket, best)
    finally:
        self.probe_budget = saved
AdaptiveK.probe_interval = probe_interval
def apply(ad, variant):
    for kv in variant.split("+"):
        if kv == "head": continue
        k, v = kv.split("=")
        setattr(ad, k, float(v) if not isinstance(getattr(ad, k, 0.0), int) else int(v))
        if k == "prior_weight": ad._could_pay = {}

autos = [n for n, _ in specs if n.startswith("a")]
results = []
for t in range(T):
    assign = {a: variants[(i + t) % len(variants)] for i, a in enumerate(autos)}
    for a in autos:
        ad = copy.deepcopy(snap[a]); apply(ad, assign[a]); cases[a].engine.adaptive = ad
    names = [n for n, _ in specs]
    for setname, prompts in [("stdlib-heldout", sets["stdlib-heldout"]), ("humaneval", sets["humaneval"][:H])][: 2 if H else 1]:
        wall = Counter(); ch = {a: Counter(cases[a].engine.adaptive.chosen) for a in autos}
        for j, p in enumerate(prompts):
            order = names if (j + t) % 2 == 0 else names[::-1]
            for n in order:
                w, _ = _generate(cases[n].engine, [p], 64, n); wall[n] += w
        for a in autos:
            chosen = Counter(cases[a].engine.adaptive.chosen) - ch[a]
            r = dict(trial=t, set=setname, engine=a, variant=assign[a], ratio=wall["k2"] / wall[a], k3=wall["k2"] / wall["k3"], k2b=wall["k2"] / wall["k2b"], walls={n: round(w, 3) for n, w in wall.items()}, chosen=dict(sorted(chosen.items())))
            results.append(r)
            print(json.dumps(r), flush=True)
json.dump(results, open(os.environ.get("OUT", "/tmp/s26/cold.json"), "w"))
