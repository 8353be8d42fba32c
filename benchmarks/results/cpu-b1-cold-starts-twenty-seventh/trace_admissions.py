"""One auto engine, warmed up as the bench does, then the 12 stdlib prompts: each admission's depths,
estimates and seen counts, and each prompt's chosen (k, row depths) (benchmarks/history.md, "Twenty-seventh
session"). Ad hoc, unmaintained; arguments set AdaptiveK attributes (the cold-start script's patches):
    python benchmarks/results/cpu-b1-cold-starts-twenty-seventh/trace_admissions.py local=1 local_depths=1
"""
import sys, time, json
from pathlib import Path
import torch, inkfw
from hydra import compose, initialize_config_dir
from inkfw.bench.run import _build_case, _generate, shared_max_model_len
from inkfw.bench.plan import BenchRun
from inkfw.bench.prompt_sets import load_prompt_set
from inkfw.speculative.factory import load_tokenizer
from inkfw.bench import run as R
SRC = open("benchmarks/results/cpu-b1-cold-starts-twenty-seventh/cold_starts.py").read()
exec(SRC[SRC.index("from inkfw.speculative.adaptive import AdaptiveK"):SRC.index("specs = [")])  # patches, hook()
exec(SRC[SRC.index("def apply(ad, variant):"):SRC.index("autos = [")])
torch.set_num_threads(1)
with initialize_config_dir(config_dir=str(Path(inkfw.__file__).resolve().parent / "conf"), version_base=None):
    cfg = compose("bench", overrides=["modes=[compiled]", "batch_sizes=[1]", "num_tokens=[2,3,auto]", "hf=[]", "forward_ops=[]"])
tok = load_tokenizer(cfg.model); mcfg = R.model_config(cfg.model)
sets = {n: load_prompt_set(n, tok, 164, mcfg.logits_vocab_size, 32, 0) for n in ["stdlib-heldout", "humaneval"]}
model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)
c = _build_case(cfg, BenchRun("inkfw", "compiled", "mtp", "auto", 1), model, tok, mml, True)
hook(c.engine)
for prompts in sets.values():
    _generate(c.engine, [prompts[0]], 8, "a")
ad = c.engine.adaptive
apply(ad, "+".join(sys.argv[1:]) or "head")
print("costs", [round(x*1e3,2) for x in ad.costs_now(1)], "prompt_s", ad.prompt_s, flush=True)
orig_choose, orig_depths = AdaptiveK.choose, AdaptiveK.depths_for
log = []
def choose(self, bucket, row_depths=None, probe=True):
    k = orig_choose(self, bucket, row_depths, probe); log.append(("k", k, tuple(row_depths or ()))); return k
def depths_for(self, bucket, pp, nt, running=()):
    m = orig_depths(self, bucket, pp, nt, running)
    print("admit", pp, nt, tuple(running), "->", m, "est", [round(a,2) for a in self.acceptance()], "seen", [round(s,1) for s in self.seen], "best", self.best_k(1), "best@m", self.best_k(1,[m]), flush=True)
    return m
AdaptiveK.choose, AdaptiveK.depths_for = choose, depths_for
for j, p in enumerate(sets["stdlib-heldout"]):
    n0 = len(log); w, _ = _generate(c.engine, [p], 64, "a")
    from collections import Counter
    print(f"prompt {j} wall {w:.3f} ks", dict(Counter((k, rd) for _, k, rd in log[n0:])), flush=True)
