"""Per prompt: a fixed k = 3 engine's acceptance at positions 1-3 (rate/drafts that reached it), over
all its steps and its first 4 (benchmarks/history.md, "Twenty-seventh session"). Ad hoc, unmaintained:
    python benchmarks/results/cpu-b1-cold-starts-twenty-seventh/acceptance_by_prompt.py
"""
import torch, inkfw
from pathlib import Path
from hydra import compose, initialize_config_dir
from inkfw.bench.run import _build_case, _generate, shared_max_model_len
from inkfw.bench.plan import BenchRun
from inkfw.bench.prompt_sets import load_prompt_set
from inkfw.speculative.factory import load_tokenizer
from inkfw.bench import run as R
torch.set_num_threads(1)
with initialize_config_dir(config_dir=str(Path(inkfw.__file__).resolve().parent / "conf"), version_base=None):
    cfg = compose("bench", overrides=["modes=[compiled]", "batch_sizes=[1]", "num_tokens=[3]", "hf=[]", "forward_ops=[]"])
tok = load_tokenizer(cfg.model); mcfg = R.model_config(cfg.model)
sets = {n: load_prompt_set(n, tok, 164, mcfg.logits_vocab_size, 32, 0) for n in ["stdlib-heldout", "humaneval"]}
model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)
c = _build_case(cfg, BenchRun("inkfw", "compiled", "mtp", 3, 1), model, tok, mml, True)
steps = []
orig = c.engine.metrics.record
def rec(counts, accepted):
    steps.append((list(counts), list(accepted))); return orig(counts, accepted)
c.engine.metrics.record = rec
def rates(st):
    seen=[0]*3; acc=[0]*3
    for ns, As in st:
        for n, a in zip(ns, As):
            for i in range(min(n, a+1)):
                seen[i]+=1; acc[i]+= i<a
    return [f"{a/s:.2f}/{s}" if s else "-" for a,s in zip(acc,seen)]
for name in ["stdlib-heldout", "humaneval"]:
    allst=[]
    for j, p in enumerate(sets[name][:12 if name.startswith("std") else 30]):
        steps.clear(); _generate(c.engine, [p], 64, "k3"); allst += steps
        first = steps[:4]
        print(name, j, "all", rates(steps), "first 4 steps", rates(first), flush=True)
    print(name, "TOTAL", rates(allst))
