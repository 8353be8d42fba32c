"""Set-up, serving in turn, cold-start trials and step timing shared by this folder's ad hoc
scripts (benchmarks/history.md, "Twenty-eighth session") and the twenty-ninth session's; unmaintained,
like them. Each script runs from the repository root, and Python puts this folder first on its
path (or the script puts it there), so ``import harness`` finds this file."""
import contextlib
import copy
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, ContextManager, NamedTuple

import torch
from hydra import compose, initialize_config_dir

import inkfw
from inkfw.bench import run as R
from inkfw.bench.plan import BenchRun
from inkfw.bench.prompt_sets import load_prompt_set
from inkfw.bench.run import _build_case, _generate, shared_max_model_len
from inkfw.speculative.factory import load_tokenizer


class Setup(NamedTuple):
    cfg: Any
    tokenizer: Any
    sets: dict  # prompt set -> token ids of its prompts (stdlib-heldout, humaneval)
    model: Any  # one model every engine shares
    max_model_len: int


def setup(num_tokens: str) -> Setup:
    """The bench's compiled batch-1 config (``num_tokens``, e.g. "[2,3,auto]"), both prompt sets,
    one shared model and the engines' max_model_len, as scripts/bench.py makes them (1 thread)."""
    torch.set_num_threads(1)
    with initialize_config_dir(config_dir=str(Path(inkfw.__file__).resolve().parent / "conf"), version_base=None):
        cfg = compose("bench", overrides=["modes=[compiled]", "batch_sizes=[1]", f"num_tokens={num_tokens}", "hf=[]", "forward_ops=[]"])
    tok = load_tokenizer(cfg.model)
    mcfg = R.model_config(cfg.model)
    sets = {n: load_prompt_set(n, tok, 164, mcfg.logits_vocab_size, 32, 0) for n in ["stdlib-heldout", "humaneval"]}
    model = R.build_model(cfg.model, mtp_depths=None, dtype=torch.float32, device=torch.device("cpu"), embed_source="backbone_norm")
    mml = shared_max_model_len(max(len(p) for s in sets.values() for p in s) + 64 + 8 + 16, mcfg.max_position_embeddings)
    return Setup(cfg, tok, sets, model, mml)


def build(s: Setup, k, name: str):
    """A compiled batch-1 engine's case at k (an int or "auto"), warmed up as the bench warms it:
    ``Engine.warmup``, then 8 tokens of each prompt set's first prompt."""
    t0 = time.time()
    case = _build_case(s.cfg, BenchRun("inkfw", "compiled", "mtp", k, 1), s.model, s.tokenizer, s.max_model_len, True)
    for prompts in s.sets.values():
        _generate(case.engine, [prompts[0]], 8, name)
    print(f"built {name} {time.time() - t0:.0f}s", flush=True)
    return case


def time_steps(engine, on_step: Callable[[dict], None]) -> None:
    """Time every step of ``engine`` and call ``on_step`` with what it was: ``k`` (the round's k,
    None where no round drafted), ``seconds``, ``rows`` (running requests before it), ``prompt``
    (it prefilled), ``draft_s`` (its drafting seconds), ``probed``, and ``steady``: it prefilled
    nothing, took no part in a probe and drafted the k the step before drafted (so it verified k
    drafts and drafted k), with k forced by nothing."""
    state = {"k": None, "prev": None}
    round_k, step = engine._round_k, engine.step

    def recording_round_k(*args, **kwargs):
        state["k"] = round_k(*args, **kwargs)
        return state["k"]

    def timed_step():
        state["k"] = None
        ad, times = engine.adaptive, engine.times
        prompt_steps, draft_s, probes = times.prompt_steps, times.draft_s, ad.probes if ad is not None else 0
        rows = len(engine.running)
        t = time.perf_counter()
        out = step()
        seconds = time.perf_counter() - t
        probed = ad is not None and ad.probes > probes
        prompt = times.prompt_steps > prompt_steps
        k, prev = state["k"], state["prev"]
        steady = k is not None and k == prev and not prompt and not probed and engine._forced_k is None
        on_step(dict(k=k, seconds=seconds, rows=rows, prompt=prompt, draft_s=times.draft_s - draft_s, probed=probed, steady=steady))
        state["prev"] = None if probed else k
        return out

    engine._round_k, engine.step = recording_round_k, timed_step


def serve_in_turn(engines: dict, prompts, flip: int = 0, around: Callable[[str], ContextManager] | None = None) -> Counter:
    """Every engine of ``engines`` (name -> engine) decodes each prompt alone, 64 new tokens, EOS
    ignored, in turn: the given order for prompt j where ``(j + flip)`` is even, reversed otherwise.
    ``around(name)``: a context each decode runs in (a profiler). Returns wall seconds per engine."""
    wall: Counter = Counter()
    names = list(engines)
    for j, prompt in enumerate(prompts):
        for n in names if (j + flip) % 2 == 0 else names[::-1]:
            with around(n) if around is not None else contextlib.nullcontext():
                wall[n] += _generate(engines[n], [prompt], 64, n)[0]
    return wall


def warm_states(engines: dict) -> dict:
    """A copy of each adaptive engine's AdaptiveK after warm-up (what every trial starts from),
    with its costs, estimates and best k printed."""
    warm = {n: copy.deepcopy(e.adaptive) for n, e in engines.items() if e.adaptive is not None}
    for n, ad in warm.items():
        print(n, "costs_ms", [round(x * 1e3, 2) for x in ad.costs_now(1)], "acc", [round(x, 2) for x in ad.acceptance()],
              "best", ad.best_k(1), "prompt_s", ad.prompt_s, flush=True)
    return warm


def cold_start_trials(s: Setup, engines: dict, trials: int, humaneval: int, start: Callable[[int], None],
                      line: Callable[[int, str, str, Counter, Counter], dict], out: str) -> list:
    """``trials`` cold starts: each calls ``start(trial)`` (it gives every adaptive engine the
    AdaptiveK it starts from), then serves the 12 stdlib prompts and the first ``humaneval``
    HumanEval prompts (none: stdlib only) in turn (:func:`serve_in_turn`, flipped per trial). One
    JSON line per trial, set and adaptive engine: ``line(trial, set, engine, walls, k chosen in the
    set)``, printed, collected, and all of them written to ``$OUT`` (default ``out``)."""
    autos = [n for n, e in engines.items() if e.adaptive is not None]
    sets = [("stdlib-heldout", s.sets["stdlib-heldout"]), ("humaneval", s.sets["humaneval"][:humaneval])]
    results = []
    for t in range(trials):
        start(t)
        for set_name, prompts in sets[: 2 if humaneval else 1]:
            before = {a: Counter(engines[a].adaptive.chosen) for a in autos}
            wall = serve_in_turn(engines, prompts, t)
            for a in autos:
                results.append(line(t, set_name, a, wall, Counter(engines[a].adaptive.chosen) - before[a]))
                print(json.dumps(results[-1]), flush=True)
    json.dump(results, open(os.environ.get("OUT", out), "w"))
    return results
