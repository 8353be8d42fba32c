"""Eager decode batches padded to their bucket (engine.pad_batches=true, the old default) against
unpadded (null, the new default), side by side in one process (benchmarks/history.md, "Thirtieth
session"). Unmaintained, like the other sessions' scripts. From the repository root:

    python benchmarks/results/cpu-eager-unpadded-thirtieth/padding.py BATCH NUM_PROMPTS REPEATS SETS KS

e.g. ``... padding.py 16 32 3 stdlib-heldout,humaneval 0,2,auto``. Engines are built as
scripts/bench.py builds them (eager, 1 thread, EOS ignored, 64 new tokens, warmed up at every
bucket their batches pass through, then one unmeasured batch per set); each (k, padding) engine
decodes each closed batch in turn, order alternating; walls summed per set. Prints one JSON line
per engine and set, with its decode and prompt seconds and whether its greedy outputs equal the
padded plain engine's."""
import json
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

batch, num_prompts, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
set_names, ks = sys.argv[4].split(","), sys.argv[5].split(",")
torch.set_num_threads(1)
conf = str(Path(inkfw.__file__).resolve().parent / "conf")
cfgs = {}
for pad in ("true", "null"):
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfgs[pad] = compose("bench", overrides=["modes=[eager]", f"batch_sizes=[{batch}]", "hf=[]", "forward_ops=[]", f"engine.pad_batches={pad}"])
cfg = cfgs["null"]
tok = load_tokenizer(cfg.model)
mcfg = R.model_config(cfg.model)
sets = {n: load_prompt_set(n, tok, num_prompts, mcfg.logits_vocab_size, 32, 0) for n in set_names}
model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)
engines = {}
for k in ks:
    for pad in ("true", "null"):
        run = BenchRun("inkfw", "eager", "none" if k == "0" else "mtp", None if k == "0" else (k if k == "auto" else int(k)), batch)
        engines[(k, pad)] = _build_case(cfgs[pad], run, model, tok, mml, True).engine


def serve(engine, prompts):
    reqs = [engine.add_request(p, engine.sampler.defaults, max_new_tokens=64) for p in prompts]
    t, prompt0 = time.perf_counter(), engine.times.prompt_s
    engine.generate(reqs)
    wall = time.perf_counter() - t
    return wall, engine.times.prompt_s - prompt0, [r.output_token_ids for r in reqs]


for name, prompts in sets.items():  # one unmeasured batch per set
    for e in engines.values():
        serve(e, prompts[:batch])
names = list(engines)
for name, prompts in sets.items():
    walls = {n: [0.0, 0.0] for n in names}
    outs = {n: [] for n in names}
    for rep in range(repeats):
        for b, i in enumerate(range(0, len(prompts), batch)):
            order = names if (rep + b) % 2 == 0 else names[::-1]
            for n in order:
                wall, prompt_s, out = serve(engines[n], prompts[i : i + batch])
                walls[n][0] += wall
                walls[n][1] += prompt_s
                if rep == 0:
                    outs[n] += out
    reference = outs[("0", "true")]
    tokens = repeats * 64 * len(prompts)
    for (k, pad), (wall, prompt_s) in walls.items():
        e = engines[(k, pad)]
        line = {"set": name, "batch": batch, "k": k, "pad_batches": pad, "wall_s": round(wall, 3),
                "prompt_s": round(prompt_s, 3), "decode_s": round(wall - prompt_s, 3),
                "tokens_per_s": round(tokens / wall, 1),
                "vs_plain_same_padding": round(walls[("0", pad)][0] / wall, 3),
                "vs_padded_self": round(walls[(k, "true")][0] / wall, 3),
                "exact": outs[(k, pad)] == reference}
        if e.adaptive is not None:
            line["k_chosen"] = dict(sorted(e.k_chosen.items()))
        print(json.dumps(line), flush=True)
