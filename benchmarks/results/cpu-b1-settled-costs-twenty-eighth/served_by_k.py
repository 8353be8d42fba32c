"""Served decode steps by k, against warm-up's costs (BENCHMARKS.md, "Twenty-eighth session").

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
import sys, time, statistics
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import inkfw
from inkfw.bench import run as R
from inkfw.bench.plan import BenchRun
from inkfw.bench.prompt_sets import load_prompt_set
from inkfw.bench.run import _build_case, _generate, shared_max_model_len
from inkfw.speculative.factory import load_tokenizer

H = int(sys.argv[1])
fixed = [int(k) for k in sys.argv[2:]] or [2, 3, 4, 5, 6]
torch.set_num_threads(1)
with initialize_config_dir(config_dir=str(Path(inkfw.__file__).resolve().parent / "conf"), version_base=None):
    cfg = compose("bench", overrides=["modes=[compiled]", "batch_sizes=[1]", "num_tokens=[auto]", "hf=[]", "forward_ops=[]"])
tok = load_tokenizer(cfg.model)
mcfg = R.model_config(cfg.model)
sets = {n: load_prompt_set(n, tok, 164, mcfg.logits_vocab_size, 32, 0) for n in ["stdlib-heldout", "humaneval"]}
model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)

steps = defaultdict(lambda: defaultdict(list))  # engine -> k -> steady step seconds
by_depths = defaultdict(list)  # (k, depths the request keeps) -> the auto engine's steady step seconds


def instrument(name, engine):
    state = {"k": None, "prev": None}
    round_k = engine._round_k

    def recording_round_k(*args, **kwargs):
        state["k"] = round_k(*args, **kwargs)
        return state["k"]

    engine._round_k = recording_round_k
    step = engine.step

    def timed_step():
        state["k"] = None
        prompt_steps = engine.times.prompt_steps
        probes = engine.adaptive.probes if engine.adaptive is not None else 0
        t = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - t
        probed = engine.adaptive is not None and engine.adaptive.probes > probes
        k, prev = state["k"], state["prev"]
        steady = k is not None and k == prev and engine.times.prompt_steps == prompt_steps and not probed
        if steady and engine._forced_k is None:
            steps[name][k].append(seconds)
            if engine.adaptive is not None and len(engine.running) == 1:  # by the depths the request keeps
                by_depths[(k, engine._depths_kept(engine.running[0]))].append(seconds)
        state["prev"] = None if probed else k
        return out

    engine.step = timed_step


specs = [("auto", "auto")] + [(f"k{k}", k) for k in fixed]
cases = {}
for name, k in specs:
    t0 = time.time()
    c = _build_case(cfg, BenchRun("inkfw", "compiled", "mtp", k, 1), model, tok, mml, True)
    for prompts in sets.values():
        _generate(c.engine, [prompts[0]], 8, name)
    instrument(name, c.engine)
    cases[name] = c
    print(f"built {name} {time.time()-t0:.0f}s", flush=True)
ad = cases["auto"].engine.adaptive
warm = ad.costs_now(1)
print("warm-up costs_now ms", [round(x * 1e3, 2) for x in warm], flush=True)

wall = defaultdict(float)
names = [n for n, _ in specs]
for j, p in enumerate(sets["humaneval"][:H]):
    for n in names if j % 2 == 0 else names[::-1]:
        w, _ = _generate(cases[n].engine, [p], 64, n)
        wall[n] += w
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
