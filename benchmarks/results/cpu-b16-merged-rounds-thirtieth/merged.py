"""Drafting rounds grouped by round shape (this session's change) against grouped by the depths
each row keeps (before it), side by side in one process: two eager `auto` engines at batch 16,
built and warmed up as scripts/bench.py builds them (benchmarks/history.md, "Thirtieth session").
Unmaintained. From the repository root:

    python benchmarks/results/cpu-b16-merged-rounds-thirtieth/merged.py REPEATS

Each repeat serves both prompt sets in closed batches of 16 (12 stdlib prompts, 32 HumanEval),
64 new tokens, EOS ignored, every engine in turn, order alternating; prints walls, drafting
rounds and steps per engine and set."""
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

import inkfw
from inkfw.bench import run as R
from inkfw.bench.plan import BenchRun
from inkfw.bench.prompt_sets import load_prompt_set
from inkfw.bench.run import _build_case, shared_max_model_len
from inkfw.speculative.factory import load_tokenizer

repeats = int(sys.argv[1])
torch.set_num_threads(1)
with initialize_config_dir(config_dir=str(Path(inkfw.__file__).resolve().parent / "conf"), version_base=None):
    cfg = compose("bench", overrides=["modes=[eager]", "batch_sizes=[16]", "hf=[]", "forward_ops=[]"])
tok = load_tokenizer(cfg.model)
mcfg = R.model_config(cfg.model)
sets = {n: load_prompt_set(n, tok, 32, mcfg.logits_vocab_size, 32, 0) for n in ["stdlib-heldout", "humaneval"]}
model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)
engines, rounds = {}, {}
for name in ("by-shape", "by-depths"):
    e = _build_case(cfg, BenchRun("inkfw", "eager", "mtp", "auto", 16), model, tok, mml, True).engine
    engines[name], rounds[name] = e, [0]
    propose = e.drafter.propose

    def counted(*args, _propose=propose, _n=rounds[name], **kwargs):
        _n[0] += 1
        return _propose(*args, **kwargs)

    e.drafter.propose = counted
    if name == "by-depths":  # before: rows of another number of depths kept draft apart
        shape = e.drafter.round_shape
        e.drafter.round_shape = lambda s, k=None, _shape=shape: (*_shape(s, k), s.depths)


def serve(engine, prompts):
    reqs = [engine.add_request(p, engine.sampler.defaults, max_new_tokens=64) for p in prompts]
    t = time.perf_counter()
    engine.generate(reqs)
    return time.perf_counter() - t, [r.output_token_ids for r in reqs]


for prompts in sets.values():  # one unmeasured batch per set
    for e in engines.values():
        serve(e, prompts[:16])
names = list(engines)
for set_name, prompts in sets.items():
    walls = {n: 0.0 for n in names}
    r0 = {n: rounds[n][0] for n in names}
    s0 = {n: engines[n].times.num_steps for n in names}
    same = True
    for rep in range(repeats):
        for b, i in enumerate(range(0, len(prompts), 16)):
            outs = {}
            for n in names if (rep + b) % 2 == 0 else names[::-1]:
                wall, outs[n] = serve(engines[n], prompts[i : i + 16])
                walls[n] += wall
            same = same and outs["by-shape"] == outs["by-depths"]
    for n in names:
        print(f"{set_name} {n}: {walls[n]:.2f} s, {rounds[n][0] - r0[n]} rounds in {engines[n].times.num_steps - s0[n]} steps, "
              f"by-depths over this {walls['by-depths'] / walls[n]:.3f}x, outputs equal {same}", flush=True)
