"""Loopback servers side by side (benchmarks/history.md, "Thirtieth session"): plain decoding, `auto`,
and `auto` with running requests' depths never lowered (the engine before this session's
change), each warmed up as scripts/serve.py warms it, all in one process. Unmaintained, like
the other sessions' scripts. From the repository root:

    python benchmarks/results/cpu-server-thirtieth/server_auto.py CONCURRENCY REPEATS [NUM_REQUESTS]

Each repeat loads every server in turn (order alternating) with NUM_REQUESTS (64) streamed
greedy completions of 32 tokens, held-out stdlib prompts, CONCURRENCY in flight; prints each
repeat's walls and the depths each `auto` engine admitted with, then the summed walls."""
import asyncio
import collections
import logging
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

import inkfw
from inkfw.llm import LLM
from inkfw.server.app import create_app
from inkfw.server.bench import _level, load_prompts
from inkfw.server.run import serve_in_thread
from inkfw.speculative.factory import build_engine

concurrency, repeats = int(sys.argv[1]), int(sys.argv[2])
num_requests = int(sys.argv[3]) if len(sys.argv) > 3 else 64
logging.getLogger("httpx").setLevel(logging.WARNING)
conf = str(Path(inkfw.__file__).resolve().parent / "conf")
variants = {"none": ["drafter=none"], "auto": ["spec.num_tokens=auto"], "auto-unlowered": ["spec.num_tokens=auto"]}
llms = {}
for name, overrides in variants.items():
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose("bench_server", overrides=overrides)
    engine, tokenizer = build_engine(cfg)
    if name == "auto-unlowered":
        engine._lower_running_depths = lambda *_: None
    llms[name] = LLM.from_engine(engine, tokenizer, cfg)
    print(name, f"warm-up {llms[name].warmup():.1f} s", flush=True)
prompts = load_prompts(cfg.bench.prompts_file, num_requests)
walls = collections.defaultdict(list)
with (
    serve_in_thread(create_app(llms["none"])) as u0,
    serve_in_thread(create_app(llms["auto"])) as u1,
    serve_in_thread(create_app(llms["auto-unlowered"])) as u2,
):
    urls = {"none": u0, "auto": u1, "auto-unlowered": u2}
    for url in urls.values():  # one unmeasured request each
        asyncio.run(_level(url, prompts[:1], 1, 32))
    for rep in range(repeats):
        names = list(urls) if rep % 2 == 0 else list(urls)[::-1]
        line = []
        for name in names:
            e = llms[name].engine
            admitted = collections.Counter(e.depths_admitted)
            _, wall = asyncio.run(_level(urls[name], prompts, concurrency, 32))
            walls[name].append(wall)
            depths = {str(k): v - admitted[k] for k, v in e.depths_admitted.items() if v - admitted[k]}
            line.append(f"{name} {wall:.2f} s" + (f" depths {depths}" if name != "none" else ""))
        print(f"repeat {rep}:", "; ".join(line), flush=True)
total = {name: sum(w) for name, w in walls.items()}
for name, wall in total.items():
    extra = f", depths lowered {llms[name].engine.depths_lowered}" if name == "auto" else ""
    print(f"{name}: {wall:.2f} s, {repeats * num_requests / wall:.2f} req/s, vs none {total['none'] / wall:.3f}x{extra}")
