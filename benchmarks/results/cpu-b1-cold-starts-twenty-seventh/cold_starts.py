"""Cold starts of `spec.num_tokens=auto`, many per process (benchmarks/history.md, "Twenty-seventh session"; the
twenty-sixth session's script with one more patch, local).

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
budget while the optimistic best k differs from the estimates' best; probe_budget otherwise), and
local (the position just past the estimates' best k at its upper bound at that confidence, for the
k of every step and the depths a request keeps; where the estimates' best is 0, HEAD's choice), and
local_depths (with local: a request keeps the depths the estimates choose, m0, or more where they
pay with position m0 + 1 at its upper bound at that confidence; this replaces local's depths rule).
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
from inkfw.speculative.adaptive import AdaptiveK
# The patches below are for the code before ca21d0c (the variants of processes G-I); from ca21d0c
# on, AdaptiveK keeps requests itself, and only "head" runs (process J).
if not hasattr(AdaptiveK, "finish_request"):
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
    def local_acceptance(self, bucket, row_depths=None):
        """The estimates with the position just past their best k at its upper bound at confidence
        ``local`` (None: the estimates' best is 0 or max_k, or the patch is off)."""
        u = getattr(self, "local", 0.0)
        b = self.best_k_at(bucket, 0.0, row_depths) if u else 0
        if not u or b == 0 or b >= self.max_k:
            return None
        acc = self.acceptance()
        acc[b] = self.acceptance_bounds(u)[b]
        return acc
    AdaptiveK.local_acceptance = local_acceptance
    _best_k_before_local = AdaptiveK.best_k
    def best_k_local(self, bucket, row_depths=None):
        acc = local_acceptance(self, bucket, row_depths)
        if acc is None:
            return _best_k_before_local(self, bucket, row_depths)
        return self._best_k_given(bucket, acc, row_depths)
    AdaptiveK.best_k = best_k_local
    src = textwrap.dedent(inspect.getsource(AdaptiveK.depths_for))
    assert "self._row_saving(bucket, None, m)" in src
    src = src.replace("P, expected = self.lookahead", "local = getattr(self, '_depths_acceptance', None) or self.local_acceptance(bucket)\n    P, expected = self.lookahead")
    src = src.replace("self._row_saving(bucket, None, m)", "self._row_saving(bucket, self.acceptance_bounds(self.ucb) if getattr(self, 'ucb', 0.0) else local, m)")
    ns = {}
    exec(src, AM.__dict__, ns)
    AdaptiveK.depths_for = ns["depths_for"]
    _depths_before_local = AdaptiveK.depths_for
    def depths_for_local(self, bucket, prompt_positions, new_tokens, running=()):
        # local_depths: the depths by the estimates alone (m0), then again with position m0 + 1 at
        # its upper bound at confidence ``local_depths`` (instead of local's position past the best k)
        u = getattr(self, "local_depths", 0.0)
        if not u:
            return _depths_before_local(self, bucket, prompt_positions, new_tokens, running)
        self._depths_acceptance = self.acceptance()
        try:
            m0 = _depths_before_local(self, bucket, prompt_positions, new_tokens, running)
            if m0 >= self.lookahead:
                return m0
            self._depths_acceptance[m0] = self.acceptance_bounds(u)[m0]
            return _depths_before_local(self, bucket, prompt_positions, new_tokens, running)
        finally:
            self._depths_acceptance = None
    AdaptiveK.depths_for = depths_for_local
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
    # per_request: acceptance estimated per request on top of a pool of requests. Every AdaptiveK
    # (HEAD's too, so the snapshot holds it) also keeps each running request's counts (``_req``) and a
    # shadow pool that each finished request enters as at most one unit per position (weight
    # min(1, seen / request_cap), its rate; the pool decays request_decay per request that saw the
    # position). With per_request set: HEAD's pooled counts are replaced by the shadow pool, a step's
    # choice at batch 1 uses the running request's estimate (its counts plus request_weight
    # pseudo-observations at the pool's estimate), and upper bounds count those observations.
    from inkfw.speculative.metrics import drafts_reached
    _observe_head, _acceptance_head, _bounds_head = AdaptiveK.observe, AdaptiveK.acceptance, AdaptiveK.acceptance_bounds
    def observe_pr(self, num_drafts, num_accepted):
        rows = getattr(self, "_rows", None)
        if rows is not None and len(rows) == len(num_drafts):
            req = self.__dict__.setdefault("_req", {})
            for rid, n, a in zip(rows, num_drafts, num_accepted):
                seen, acc = req.setdefault(rid, ([0.0] * self.max_k, [0.0] * self.max_k))
                for i in range(drafts_reached(n, a)):
                    seen[i] += 1; acc[i] += i < a
        if not getattr(self, "per_request", 0.0):
            _observe_head(self, num_drafts, num_accepted)
    def finish_pr(self, rid):
        got = self.__dict__.get("_req", {}).pop(rid, None)
        if got is None:
            return
        seen, acc = got
        ps = self.__dict__.setdefault("_pool_seen", [0.0] * self.max_k); pa = self.__dict__.setdefault("_pool_acc", [0.0] * self.max_k)
        cap, d = getattr(self, "request_cap", 4.0), getattr(self, "request_decay", 0.9)
        for i in range(self.max_k):
            if seen[i]:
                w = min(1.0, seen[i] / cap)
                ps[i] = d * ps[i] + w; pa[i] = d * pa[i] + w * acc[i] / seen[i]
        if getattr(self, "per_request", 0.0):
            self.seen, self.accepted = list(ps), list(pa)
    def _current_counts(self):
        rid = getattr(self, "_current", None)
        return None if rid is None else self.__dict__.get("_req", {}).get(rid)
    def acceptance_pr(self):
        pool = _acceptance_head(self)
        cur = _current_counts(self) if getattr(self, "per_request", 0.0) else None
        if cur is None:
            return pool
        w0 = getattr(self, "request_weight", 4.0)
        return [(a + w0 * p) / (s + w0) for s, a, p in zip(cur[0], cur[1], pool)]
    def bounds_pr(self, confidence):
        cur = _current_counts(self) if getattr(self, "per_request", 0.0) else None
        if cur is None:
            return _bounds_head(self, confidence)
        w0 = getattr(self, "request_weight", 4.0)
        return [min(1.0, a + confidence * math.sqrt(a * (1.0 - a) / (s + w0))) for a, s in zip(self.acceptance(), cur[0])]
    import math
    AdaptiveK.observe, AdaptiveK.finish, AdaptiveK.acceptance, AdaptiveK.acceptance_bounds = observe_pr, finish_pr, acceptance_pr, bounds_pr
    def hook(engine):
        verify = engine.verifier.verify
        def verify_rows(kv, decodes, *args, **kw):
            if engine.adaptive is not None:
                engine.adaptive._rows = [r.id for r in decodes]
            return verify(kv, decodes, *args, **kw)
        engine.verifier.verify = verify_rows
        release, round_k = engine._release, engine._round_k
        def release_pr(r):
            if engine.adaptive is not None:
                engine.adaptive.finish(r.id)
            return release(r)
        def round_k_pr(bucket, row_depths, probe=True):
            ad = engine.adaptive
            if ad is None:
                return round_k(bucket, row_depths, probe)
            ad._current = engine.running[0].id if len(engine.running) == 1 else None
            try:
                return round_k(bucket, row_depths, probe)
            finally:
                ad._current = None
        engine._release, engine._round_k = release_pr, round_k_pr
else:
    def hook(engine):
        pass

specs = [("k2", 2), ("k3", 3), ("k2b", 2)] + [(f"a{i}", "auto") for i in range(NA)]
cases = {}
for name, k in specs:
    t0 = time.time()
    c = _build_case(cfg, BenchRun("inkfw", "compiled", "mtp", k, 1), model, tok, mml, True)
    if c.engine.adaptive is not None:
        hook(c.engine)
    for prompts in sets.values():
        _generate(c.engine, [prompts[0]], 8, name)
    cases[name] = c
    print(f"built {name} {time.time()-t0:.0f}s", flush=True)
snap = {n: copy.deepcopy(c.engine.adaptive) for n, c in cases.items() if c.engine.adaptive is not None}
for n, ad in snap.items():
    print(n, "costs_ms", [round(x*1e3, 2) for x in ad.costs_now(1)], "acc", [round(x, 2) for x in ad.acceptance()], "best", ad.best_k(1), "prompt_s", ad.prompt_s, flush=True)

def apply(ad, variant):
    for kv in variant.split("+"):
        if kv == "head": continue
        k, v = kv.split("=")
        setattr(ad, k, float(v) if not isinstance(getattr(ad, k, 0.0), int) else int(v))
        if k == "prior_weight": ad._could_pay = {}
        if k == "per_request" and float(v):  # the shadow pool replaces HEAD's pooled counts
            ad.seen, ad.accepted = list(ad.__dict__.get("_pool_seen", [0.0] * ad.max_k)), list(ad.__dict__.get("_pool_acc", [0.0] * ad.max_k))
    ad._req = {}

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
json.dump(results, open(os.environ.get("OUT", "/tmp/s27/cold.json"), "w"))
