"""scripts/bench.py (inkfw.bench): which runs a benchmark makes, the HF baseline's token counts,
the greedy exactness check, and tiny end-to-end runs (the shipped checkpoint against HF, the
random-init debug preset, the GPU preset on a CPU) writing JSON, Markdown and PNGs.

Only the shape and consistency of the numbers are checked, never a speed.
"""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console
from rich.progress import Progress

from helpers.bench import bench_cfg, restore_threads  # noqa: F401
from helpers.cuda_graphs import RecordedCudaGraphs
from inkfw.bench import run_bench
from inkfw.bench.exactness import ExactnessCheck, differing_requests, first_difference
from inkfw.bench.hf_baseline import HfBaseline
from inkfw.bench.plan import BenchRun, interleaved_batches, plan_runs, round_order
from inkfw.bench.prompt_sets import batch_requests, load_prompt_set
from inkfw.bench.run import (
    adaptive_predicted_speedup,
    add_repeat_ratios,
    add_speedups,
    bench_options,
    hf_load_kwargs,
    shared_max_model_len,
)
from inkfw.bench.timing import predicted_speedup
from inkfw.errors import ConfigError
from inkfw.eval_acceptance import humaneval_prompts
from inkfw.reporting import bench_acceptance_plot, bench_markdown, bench_plot, bench_table
from inkfw.speculative.engine import Engine
from inkfw.speculative.factory import load_tokenizer
from inkfw.speculative.step import bucket_for

ROOT = Path(__file__).resolve().parent.parent
CKPT = ROOT / "checkpoints" / "inkling-tiny"
PNG = b"\x89PNG\r\n\x1a\n"
# the shipped checkpoint, two held-out prompts, a few tokens, eager only
SHIPPED = [
    "prompt_sets=[stdlib-heldout]",
    "num_prompts=2",
    "max_new_tokens=4",
    "modes=[eager]",
    "num_tokens=[2,9]",  # k = 9 > D = 8 cycles the depths
    "warmup_tokens=2",
    "forward_ops=[uncached]",
    "forward_repeats=1",
    "threads=1",
]
DEBUG = [  # the random-init debug preset: random prompts, no HF baseline
    "model=inkling-debug",
    "prompt_sets=[random]",
    "hf=[]",
    "modes=[eager]",
    "num_tokens=[4]",
    "batch_sizes=[1,2]",
    "num_prompts=2",
    "prompt_len=6",
    "max_new_tokens=5",
    "warmup_tokens=2",
    "forward_ops=[]",
    "threads=1",
]


# ------------------------------------------------------------------ the plan
def test_plan_expands_the_lists_into_one_round():
    runs = plan_runs(["none", "mtp"], [2, "auto"], ["eager", "compiled"], [1, 16], ["generate", "generate_mtp"])
    names = [r.name for r in runs]
    assert names[:2] == ["hf generate", "hf generate(use_mtp)"]  # HF first, at batch 1 only
    assert all(r.batch_size == 1 and r.mode == "hf" for r in runs[:2])
    assert names[2:8] == [
        "eager none b1",
        "eager mtp k=2 b1",
        "eager mtp k=auto b1",
        "compiled none b1",
        "compiled mtp k=2 b1",
        "compiled mtp k=auto b1",
    ]
    assert len(runs) == 2 + 2 * 2 * 3 and names[-1] == "compiled mtp k=auto b16"
    assert len({r.engine_key for r in runs[2:]}) == 12  # one engine per inkfw run
    assert runs[1].use_mtp and not runs[0].use_mtp and not runs[3].use_mtp
    # no HF, one drafter: only the inkfw runs of that drafter
    only = plan_runs(["mtp"], [1, 8], ["eager"], [4], [])
    assert [r.name for r in only] == ["eager mtp k=1 b4", "eager mtp k=8 b4"]
    assert only[0] == BenchRun("inkfw", "eager", "mtp", 1, 4)
    # auto_modes: k = auto in those modes only (the GPU check: with CUDA graphs)
    gpu = plan_runs(["none", "mtp"], [8, "auto"], ["eager", "graphs"], [1], [], auto_modes=["graphs"])
    assert [r.name for r in gpu] == [
        "eager none b1",
        "eager mtp k=8 b1",
        "graphs none b1",
        "graphs mtp k=8 b1",
        "graphs mtp k=auto b1",
    ]
    # the GPU check's preset: k = 8 only (auto's warm-up ran it past its 8 minutes); auto when asked
    assert {r.num_tokens for r in bench_options(bench_cfg(name="bench_gpu")).runs()} == {0, 8}  # 0: plain
    with_auto = bench_cfg("num_tokens=[8,auto]", "auto_modes=[graphs]", name="bench_gpu")
    assert [r.name for r in bench_options(with_auto).runs() if r.num_tokens == "auto"] == [
        "graphs mtp k=auto b1",
        "graphs mtp k=auto b16",
    ]
    # repeats alternate the plan's order and its reverse
    assert [round_order(runs, rep) for rep in range(3)] == [runs, runs[::-1], runs]


def test_interleaving_cuts_a_set_into_batches_every_run_fills():
    prompts = [[i] for i in range(7)]
    b1 = plan_runs(["none", "mtp"], [2], ["eager"], [1], ["generate"])
    assert interleaved_batches(prompts, b1, "set") == [prompts]
    assert interleaved_batches(prompts, b1, "batch") == [[p] for p in prompts]  # batch 1 alone: each prompt
    b2_b3 = plan_runs(["none"], [2], ["eager"], [2, 3], [])
    assert interleaved_batches(prompts, b2_b3, "batch") == [prompts[:6], prompts[6:]]  # lcm(2, 3) = 6
    assert interleaved_batches(prompts, plan_runs(["none"], [2], ["eager"], [1, 16], []), "batch") == [prompts]


def test_requests_fill_whole_batches():
    prompts = [[1], [2], [3]]
    assert batch_requests(prompts, 1) == prompts
    assert batch_requests(prompts, 2) == [[1], [2], [3], [1]]
    assert batch_requests(prompts, 16) == [prompts[i % 3] for i in range(16)]


def test_prompt_sets_come_from_eval_acceptance():
    tok = load_tokenizer({"path": str(CKPT)})
    heldout = load_prompt_set("stdlib-heldout", tok, None, 4096, 32, 0)
    first_line = json.loads((ROOT / "benchmarks/prompts/stdlib-heldout.jsonl").read_text().splitlines()[0])
    assert len(heldout) == 12 and heldout[0] == tok.encode(first_line["prompt"]).ids
    humaneval = load_prompt_set("humaneval", tok, 3, 4096, 32, 0)
    assert len(humaneval) == 3 and humaneval[0] == tok.encode(humaneval_prompts()[0]).ids
    random = load_prompt_set("random", None, 4, 100, 7, seed=1)
    assert [len(p) for p in random] == [7] * 4 and random == load_prompt_set("random", None, 4, 100, 7, seed=1)
    assert all(3 <= t < 100 for p in random for t in p)


# ------------------------------------------------------------------ HF baseline
def test_hf_baseline_counts_the_tokens_it_generated():
    tok = load_tokenizer({"path": str(CKPT)})
    prompts = load_prompt_set("stdlib-heldout", tok, 2, 4096, 32, 0)
    plain = HfBaseline(CKPT, torch.float32, torch.device("cpu"), [2], ignore_eos=True)
    run = plain.generate(prompts, 3, use_mtp=False)
    assert [len(o) for o in run.outputs] == [3, 3] and run.tokens == 6 and run.wall_s > 0
    assert plain.generate(prompts, 3, use_mtp=True).outputs == run.outputs  # HF MTP is lossless
    # the first generated token of prompt 0 taken as EOS: HF stops there, unless EOS is ignored
    eos = run.outputs[0][0]
    stopping = HfBaseline(CKPT, torch.float32, torch.device("cpu"), [eos], ignore_eos=False)
    stopped = stopping.generate(prompts, 3, use_mtp=False)
    assert len(stopped.outputs[0]) == 1 and stopped.tokens == 1 + len(stopped.outputs[1])
    ignoring = HfBaseline(CKPT, torch.float32, torch.device("cpu"), [eos], ignore_eos=True)
    assert ignoring.generate(prompts, 3, use_mtp=False).tokens == 6


def test_hf_load_passes_from_pretrained_arguments_and_leaves_nulls_to_hf():
    """``hf_load``: from_pretrained arguments of the HF model (the GPU check loads HF's per-expert
    MoE loop, ``experts_implementation=eager``); null leaves HF's choice, a non-mapping is refused."""
    assert hf_load_kwargs(bench_cfg()) == {}  # null: HF's default (grouped_mm)
    assert hf_load_kwargs(bench_cfg(name="bench_gpu")) == {"experts_implementation": "eager"}
    chosen = HfBaseline(
        CKPT,
        torch.float32,
        torch.device("cpu"),
        [2],
        True,
        hf_load_kwargs(bench_cfg("hf_load.experts_implementation=eager")),
    )
    default = HfBaseline(CKPT, torch.float32, torch.device("cpu"), [2], True, hf_load_kwargs(bench_cfg()))
    assert (chosen.model.config._experts_implementation, default.model.config._experts_implementation) == (
        "eager",
        "grouped_mm",
    )
    tok = load_tokenizer({"path": str(CKPT)})
    prompts = load_prompt_set("stdlib-heldout", tok, 1, 4096, 32, 0)
    assert chosen.generate(prompts, 3, use_mtp=False).outputs == default.generate(prompts, 3, use_mtp=False).outputs
    with pytest.raises(ConfigError, match="hf_load must map from_pretrained's argument names"):
        hf_load_kwargs({"hf_load": ["experts_implementation=eager"]})


# ------------------------------------------------------------------ exactness
def test_exactness_passes_equal_outputs_and_flags_an_injected_mismatch():
    reference = [[5, 6, 7, 8], [1, 2, 3, 4]]
    check = ExactnessCheck()
    assert check.add("humaneval", 2, 0, "eager none b2", reference) == []  # the group's reference
    assert check.add("humaneval", 2, 0, "eager mtp k=8 b2", [list(o) for o in reference]) == []
    assert check.add("humaneval", 1, 0, "eager none b1", [[9, 9]]) == []  # another group
    assert check.ok and check.compared == 1
    injected = [[5, 6, 7, 8], [1, 2, 0, 4]]  # one token of request 1 differs
    assert check.add("humaneval", 2, 0, "graphs mtp k=8 b2", injected) == [1]
    assert not check.ok and len(check.mismatches) == 1
    m = check.mismatches[0]
    assert (m.run, m.reference, m.requests, m.first_position) == ("graphs mtp k=8 b2", "eager none b2", [1], 2)
    assert m.line() == (
        "humaneval, batch 2, repeat 1: graphs mtp k=8 b2 differs from eager none b2 in 1 request(s) [1]; "
        "first at request 1, token 2"
    )
    summary = check.summary()
    assert summary["ok"] is False and summary["mismatches"][0]["line"] == m.line()
    assert summary["references"] == {"humaneval b2": "eager none b2", "humaneval b1": "eager none b1"}
    # a shorter output differs where it ends
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2], [1, 2]) is None
    assert differing_requests([[1], [2, 3]], [[1], [2]]) == [1]


# ------------------------------------------------------------------ derived numbers
def _row(system, drafter, tps, mode="eager", batch=1, **extra):
    return {
        "system": system,
        "prompt_set": "s",
        "drafter": drafter,
        "mode": mode,
        "batch_size": batch,
        "tokens_per_s": tps,
        **extra,
    }


def test_engines_of_benches_over_other_prompts_share_one_length():
    """max_model_len sizes the KV pools the compiled graphs are specialised on: needs within one
    power of two get the same length (inductor's cache serves them all), never below the need,
    never above the model's limit."""
    assert shared_max_model_len(150, 2048) == shared_max_model_len(250, 2048) == 256
    assert shared_max_model_len(257, 2048) == shared_max_model_len(512, 2048) == 512
    assert shared_max_model_len(513, 2048) == 1024
    assert shared_max_model_len(1500, 2048) == 2048 and shared_max_model_len(1500, 1600) == 1600
    assert all(n <= shared_max_model_len(n, 4096) < 2 * max(n, 256) for n in range(1, 4097))


def test_speedups_and_predicted_speedup():
    steps = {"num_steps": 10, "draft_s": 0.0, "verify_s": 1.0}
    rows = [
        _row("hf", "none", 20.0),
        _row("hf", "mtp", 10.0),
        _row("inkfw", "none", 40.0, mean_acceptance_length=1.0, **steps),
        # tau 3 at twice plain's step cost: predicted 1.5x; measured 10 / 40
        _row("inkfw", "mtp", 10.0, mean_acceptance_length=3.0, num_steps=5, draft_s=0.4, verify_s=0.6),
        _row("inkfw", "mtp", 30.0, batch=4, mean_acceptance_length=2.0, **steps),  # no plain row at batch 4
    ]
    add_speedups(rows)
    hf, hf_mtp, plain, mtp, lone = rows
    assert hf["speedup_vs_hf"] == 1.0 and hf["speedup_vs_hf_mtp"] == 2.0 and "speedup_vs_plain" not in hf
    assert hf_mtp["speedup_vs_hf"] == 0.5
    assert plain["speedup_vs_hf"] == 2.0 and plain["speedup_vs_plain"] == 1.0 and plain["predicted_speedup"] == 1.0
    assert mtp["speedup_vs_plain"] == 0.25 and mtp["speedup_vs_hf_mtp"] == 1.0
    assert mtp["predicted_speedup"] == pytest.approx(3.0 * 0.1 / 0.2)
    assert mtp["efficiency"] == pytest.approx(0.25 / 1.5)
    assert lone["speedup_vs_plain"] is None and lone["predicted_speedup"] is None and lone["efficiency"] is None
    assert predicted_speedup({**mtp, "num_steps": 0}, plain) is None
    # auto's own expectation: E(k*) x step_s[0] / step_s[k*] at the smallest measured bucket >= B
    summary = {"costs": {"1": [1.0, 1.5, 2.0], "16": [4.0, 8.0, 16.0]}, "best_k": {"1": 2, "16": 0},
               "expected_tokens": [1.0, 1.8, 2.5]}  # fmt: skip
    assert adaptive_predicted_speedup(summary, 1) == pytest.approx(2.5 * 1.0 / 2.0)
    assert adaptive_predicted_speedup(summary, 4) == 1.0  # bucket 16 falls back to k = 0
    assert adaptive_predicted_speedup(summary, 32) is None and adaptive_predicted_speedup(None, 1) is None


def test_ratios_per_repeat_and_auto_against_the_fastest_fixed_k():
    def row(drafter, k, per_repeat, mode="eager", batch=1):
        tps = len(per_repeat) / sum(1 / x for x in per_repeat)  # equal tokens per repeat
        return _row("inkfw", drafter, tps, mode, batch, num_tokens=k, repeat_tokens_per_s=per_repeat)

    # the machine slows down 4x in repeat 2, for every run alike
    plain = row("none", 0, [100.0, 25.0])
    k2 = row("mtp", 2, [150.0, 35.0])
    k4 = row("mtp", 4, [120.0, 32.0])
    auto = row("mtp", "auto", [140.0, 38.0])
    other_mode = row("mtp", 2, [1.0, 1.0], mode="compiled")  # no plain row in its mode
    hf = _row("hf", "none", 50.0, repeat_tokens_per_s=[50.0, 12.0])
    rows = [hf, plain, k2, k4, auto, other_mode]
    add_repeat_ratios(rows)
    assert "speedup_vs_plain_per_repeat" not in hf and "best_k" not in hf
    assert plain["speedup_vs_plain_per_repeat"] == [1.0, 1.0]
    assert k2["speedup_vs_plain_per_repeat"] == pytest.approx([1.5, 1.4])
    assert k2["best_k"] is None and other_mode["speedup_vs_plain_per_repeat"] is None
    # k = 2 has the most tokens/s over both repeats (41.1 / 60.0 / 37.0 / 40.0 at k = 0 / 2 / 4 / auto)
    assert auto["best_k"] == 2 and auto["vs_best_k"] == pytest.approx(auto["tokens_per_s"] / k2["tokens_per_s"])
    assert auto["vs_best_k_per_repeat"] == pytest.approx([140 / 150, 38 / 35])
    lone = row("mtp", "auto", [1.0], mode="graphs")  # no fixed k and no plain run beside it
    add_repeat_ratios([lone])
    assert lone["best_k"] is None and lone["vs_best_k"] is None and lone["speedup_vs_plain_per_repeat"] is None


def _report(results, exactness):
    machine = {"threads": 2, "device": "cpu"}
    model = {"name": "checkpoints/inkling-tiny"}
    return {
        "machine": machine,
        "model": model,
        "max_new_tokens": 64,
        "ignore_eos": True,
        "repeats": 1,
        "one_token_forward": {},
        "results": results,
        "exactness": exactness,
    }


def test_renderings_of_auto_rows_and_a_failed_check(tmp_path):
    overhead = {
        "wall_s": 1.0, "tokens": 64, "num_steps": 20, "step_s": 0.9, "forward_s": 0.8, "overhead_ratio": 1.125,
        "overhead_ratio_per_repeat": [1.125], "step_ms": 45.0, "decode_steps": 19, "decode_step_ms": 40.0,
        "prompt_steps": 1, "prompt_s": 0.14, "non_forward_ms_per_step": 5.0, "draft_s": 0.3,
        "verify_s": 0.5, "bookkeeping_s": 0.1, "draft_forward_s": 0.25, "verify_forward_s": 0.55,
        "draft_non_forward_s": 0.05, "verify_non_forward_s": -0.05, "cache_in_forward_s": None,
        "overhead_ratio_model_only": None, "kv_bytes": 2**20, "host_reads_per_step": 1.0, "warmup_s": 3.5,
    }  # fmt: skip
    hf = _row("hf", "none", 20.0, name="hf generate", num_tokens=0, speedup_vs_hf=1.0, speedup_vs_hf_mtp=None)
    plain = _row("inkfw", "none", 40.0, name="eager none b1", num_tokens=0, mean_acceptance_length=1.0,
                 acceptance_per_position=[], chosen_k=None, speedup_vs_hf=2.0, speedup_vs_plain=1.0, **overhead)  # fmt: skip
    auto = _row("inkfw", "mtp", 30.0, name="eager mtp k=auto b1", num_tokens="auto", mean_acceptance_length=2.5,
                acceptance_per_position=[0.8, 0.7], chosen_k={"2": 30, "0": 4}, speedup_vs_hf=1.5,
                speedup_vs_plain=0.75, predicted_speedup=1.5, efficiency=0.5,
                speedup_vs_plain_per_repeat=[0.7, 0.8], vs_best_k=0.9, best_k=3,
                vs_best_k_per_repeat=[0.85, 0.93], **overhead)  # fmt: skip
    failed = ExactnessCheck()
    failed.add("s", 1, 0, "eager none b1", [[1, 2]])
    failed.add("s", 1, 0, "eager mtp k=auto b1", [[1, 3]])
    report = _report([hf, plain, auto], failed.summary())
    text = rendered(bench_table(report))
    assert (
        "0:4 2:30" in text
        and "80 70" in text
        and "0.75x" in text
        and "0.50" in text
        and "0.90x of k=3 (0.85-0.93)" in text
    )
    md = bench_markdown(report)
    assert (
        "| s | eager mtp k=auto b1 | 30.0 | 1.50x | - | 0.75x | 0.70-0.80 | 0.90x of k=3 (0.85-0.93) | 2.50 | 1.50x "
        "| 0.50 | 1.0 | 3.5 "
        "| 80 70 | 0:4 2:30 |" in md
    )
    assert "| s | hf generate | 20.0 | 1.00x | - | - | - | - | - | - | - | - | - | - | - |" in md
    assert "- s, batch 1, repeat 1: eager mtp k=auto b1 differs from eager none b1 in 1 request(s) [0]" in md
    assert bench_plot(report, tmp_path / "bench.png") and bench_acceptance_plot(report, tmp_path / "acc.png")
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG and (tmp_path / "acc.png").read_bytes()[:8] == PNG


def rendered(renderable) -> str:
    console = Console(width=400, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


# ------------------------------------------------------------------ runs
def test_shipped_checkpoint_against_hf(tmp_path):
    report = run_bench(bench_cfg(*SHIPPED, "batch_sizes=[1,2]", f"output_dir={tmp_path}"))
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["results"] == report["results"] and written["exactness"]["ok"]
    rows = {r["name"]: r for r in report["results"]}
    assert list(rows) == [
        "hf generate",
        "hf generate(use_mtp)",
        "eager none b1",
        "eager mtp k=2 b1",
        "eager mtp k=9 b1",
        "eager none b2",
        "eager mtp k=2 b2",
        "eager mtp k=9 b2",
    ]
    hf = rows["hf generate"]
    assert hf["tokens"] == 2 * 4 and hf["num_requests"] == 2 and hf["speedup_vs_hf"] == 1.0
    for r in rows.values():
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["speedup_vs_hf"] == pytest.approx(r["tokens_per_s"] / hf["tokens_per_s"])
        assert r["speedup_vs_hf_mtp"] == pytest.approx(r["tokens_per_s"] / rows["hf generate(use_mtp)"]["tokens_per_s"])
        if r["system"] == "hf":
            continue
        assert r["tokens"] == 2 * 4  # ignore_eos: every request decodes max_new_tokens; 2 prompts fill batch 2
        plain = rows[f"eager none b{r['batch_size']}"]
        assert r["speedup_vs_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
        assert r["predicted_speedup"] == pytest.approx(predicted_speedup(r, plain))
        assert r["efficiency"] == pytest.approx(r["speedup_vs_plain"] / r["predicted_speedup"])
        assert r["host_reads"] > 0 and r["host_reads_per_step"] == pytest.approx(r["host_reads"] / r["num_steps"])
        assert r["warmup_s"] >= 0 and r["chosen_k"] is None and r["adaptive_predicted_speedup"] is None  # fixed k
        k = 0 if r["drafter"] == "none" else r["num_tokens"]
        assert r["num_draft_tokens"] == k and len(r["acceptance_per_position"]) <= k
        assert 1.0 <= r["mean_acceptance_length"] <= 1 + k
        assert r["mean_acceptance_length"] == pytest.approx(1 + sum(r["acceptance_per_position"]))
    assert rows["eager mtp k=9 b1"]["mean_acceptance_length"] > 1.0  # trained depths are accepted
    # greedy: every inkfw run equals plain decoding at its batch size, and HF agrees at batch 1
    assert report["exactness"]["runs_compared"] == 4 and report["exactness"]["mismatches"] == []
    assert report["exactness"]["references"] == {
        "stdlib-heldout b1": "eager none b1",
        "stdlib-heldout b2": "eager none b2",
    }
    assert report["hf_vs_inkfw_greedy"]["stdlib-heldout hf generate"] == {"requests": 2, "differ": 0}
    fwd = report["one_token_forward"]["uncached"]
    assert fwd["top_level_ops"] > 0 and fwd["nested_ops"] >= fwd["top_level_ops"] and fwd["wall_ms"] > 0
    markdown = (tmp_path / "bench.md").read_text()
    assert "| stdlib-heldout | eager mtp k=9 b1 |" in markdown and "| stdlib-heldout | hf generate | " in markdown
    assert "top-level aten ops" in markdown and "4 runs emitted their group's reference tokens exactly" in markdown
    for png in ("bench.png", "acceptance.png", "overhead.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG


def test_debug_preset_overhead_and_profile(tmp_path, capsys):
    """A random-init preset without HF: the engine's step split and overhead per run (with the
    paged cache's own time), and cProfile listings of the engine's work outside forwards. The
    second repeat runs in reverse order."""
    report = run_bench(
        bench_cfg(*DEBUG, "repeats=2", f"output_dir={tmp_path}", "cache_time=true", "profile=true", "plot=false")
    )
    measured = [line.split(":")[0].split()[1:] for line in capsys.readouterr().out.splitlines() if " repeat " in line]
    first = [words for words in measured if words[0] == "1/2"]
    assert [words[1:] for words in first][::-1] == [words[1:] for words in measured if words[0] == "2/2"]
    assert len(first) == 4
    rows = {(r["drafter"], r["batch_size"]): r for r in report["results"]}
    assert sorted(rows) == [("mtp", 1), ("mtp", 2), ("none", 1), ("none", 2)]
    for (drafter, _), r in rows.items():
        assert r["tokens"] == 2 * 2 * 5 and r["speedup_vs_hf"] is None  # 2 repeats of 2 requests
        assert r["num_steps"] >= 2 * 5 and r["step_s"] > r["forward_s"] > 0
        assert r["overhead_ratio"] == pytest.approx(r["step_s"] / r["forward_s"]) and r["overhead_ratio"] > 1
        low, high = min(r["overhead_ratio_per_repeat"]), max(r["overhead_ratio_per_repeat"])
        assert len(r["overhead_ratio_per_repeat"]) == 2 and low <= r["overhead_ratio"] <= high
        # the phases' forwards (from the engine's observer hooks) add up to the engine's forward time
        assert r["verify_forward_s"] + r["draft_forward_s"] == pytest.approx(r["forward_s"], rel=1e-6)
        assert 0 < r["verify_forward_s"] <= r["verify_s"] and 0 <= r["draft_forward_s"] <= r["draft_s"]
        assert (r["draft_forward_s"] > 0) == (drafter == "mtp")
        assert r["num_draft_tokens"] == (4 if drafter == "mtp" else 0)
        assert 0 < r["cache_in_forward_s"] < r["forward_s"]  # the paged cache's timing hook
        assert r["overhead_ratio_model_only"] > r["overhead_ratio"]
    for batch in (1, 2):  # the MTP depths' pools come on top of the target's
        assert rows[("mtp", batch)]["kv_bytes"] > rows[("none", batch)]["kv_bytes"] > 0
    assert report["exactness"]["ok"] and report["exactness"]["runs_compared"] == 2 * 2  # mtp vs none, per repeat
    markdown = (tmp_path / "bench.md").read_text()
    assert "| random | eager mtp k=4 b2 |" in markdown and "model-only overhead" in markdown
    for name in ("eager-none-b2", "eager-mtp-k=4-b2"):
        text = (tmp_path / f"profile-random-{name}.txt").read_text()
        assert (
            text.startswith(f"{name.replace('-', ' ')} on random (profiler on)") and "Top functions by own time" in text
        )
        assert "inkfw/speculative/engine.py" in text  # the engine's own work is profiled
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.parametrize("interleave", ["batch", "set"])
def test_interleaved_runs_and_their_ratios_per_repeat(interleave, capsys, tmp_path, monkeypatch):
    """Batch 1, three prompts, two repeats: with interleave=batch every run decodes each prompt in
    turn (reversed on every other prompt), with set each run a whole set; either way each run's
    outputs are checked as one, and its tokens/s per repeat are its decodes of that repeat. The
    progress bar advances once per measured decode; each engine's warm-up is reported."""
    advanced = []
    advance = Progress.advance
    monkeypatch.setattr(Progress, "advance", lambda self, task, n=1: advanced.append(n) or advance(self, task, n))
    report = run_bench(
        bench_cfg(*DEBUG, "batch_sizes=[1]", "num_prompts=3", "num_tokens=[2,auto]", "repeats=2",
                  f"interleave={interleave}", "output_dir=null")
    )  # fmt: skip
    assert report["interleave"] == interleave
    per_repeat = 3 if interleave == "batch" else 1  # decodes per run and repeat
    rows = {r["num_tokens"]: r for r in report["results"]}
    plain, k2, auto = rows[0], rows[2], rows["auto"]
    for r in (plain, k2, auto):
        decodes = r["decodes"]
        assert r["tokens"] == 2 * 3 * 5 and len(decodes) == 2 * per_repeat
        assert [tokens for tokens, _ in decodes] == [15 // per_repeat] * len(decodes)
        assert sum(wall for _, wall in decodes) == pytest.approx(r["wall_s"])
        halves = [decodes[:per_repeat], decodes[per_repeat:]]
        assert r["repeat_tokens_per_s"] == pytest.approx([15 / sum(w for _, w in h) for h in halves])
        assert r["speedup_vs_plain_per_repeat"] == pytest.approx(
            [a / b for a, b in zip(r["repeat_tokens_per_s"], plain["repeat_tokens_per_s"])]
        )
    fastest = max((plain, k2), key=lambda r: r["tokens_per_s"])
    assert auto["best_k"] == fastest["num_tokens"] and k2["best_k"] is None
    assert auto["vs_best_k"] == pytest.approx(auto["tokens_per_s"] / fastest["tokens_per_s"])
    assert report["exactness"]["ok"] and report["exactness"]["runs_compared"] == 2 * 2  # k=2, auto per repeat
    out = capsys.readouterr().out.splitlines()
    measured = [line for line in out if line.startswith("  repeat ")]
    assert len(measured) == 2 * 3  # one line per run and repeat, whatever the interleaving
    assert advanced == [1] * (2 * 3 * per_repeat)  # repeats x runs x decodes per run and repeat
    assert sorted(line.split(":")[0] for line in out if line.startswith("  warm-up ")) == sorted(
        f"  warm-up {r['name']}" for r in report["results"]
    )  # one line per engine (here one run each)
    # each progress line ends with the seconds since the bench started: where a slow run's time went
    stamps = [re.search(r" \(at (\d+) s\)$", line) for line in out if line.startswith(("  warm-up ", "  repeat "))]
    assert len(stamps) == 2 * 3 + 3 and all(stamps)
    assert [int(m.group(1)) for m in stamps if m] == sorted(int(m.group(1)) for m in stamps if m)
    assert bench_plot(report, tmp_path / "bench.png")  # with a bar per point: the repeats' spread
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG


def test_engines_warm_up_every_bucket_their_batches_pass_through(monkeypatch):
    """A batch of 4 shrinks through buckets 2 and 1 as its requests finish: each engine warms up
    (compiles, captures, measures auto's costs) at every bucket up to its batch size, so none
    compiles while measured."""
    warmed: dict[int, list[int]] = {}  # engine max_num_seqs -> buckets warmed up
    warmup = Engine.warmup

    def recording(engine, batch_sizes=None, *args, **kwargs):
        buckets = {bucket_for(b, engine.config.batch_buckets) for b in batch_sizes or [1]}
        warmed.setdefault(engine.config.max_num_seqs, []).extend(sorted(buckets))
        return warmup(engine, batch_sizes, *args, **kwargs)

    monkeypatch.setattr(Engine, "warmup", recording)
    report = run_bench(bench_cfg(*DEBUG, "batch_sizes=[1,4]", "num_prompts=4", "drafters=[none]", "output_dir=null"))
    assert warmed == {1: [1], 4: [1, 2, 4]}
    assert all(r["warmup_s"] > 0 for r in report["results"])


def test_gpu_preset_runs_on_a_cpu_with_a_tiny_override(tmp_path, monkeypatch):
    """The GPU check's own runs (eager and CUDA graphs, plain and k = 8, batch 1 and 16, HF) on
    the CPU, its graphs through the CPU stand-in that replays recorded ops without Python
    (helpers.cuda_graphs): every run exact, each graph-captured step reading back at most one
    tensor."""
    graphs = RecordedCudaGraphs(monkeypatch)
    cfg = bench_cfg(
        "device=cpu",
        "num_prompts=2",
        "max_new_tokens=3",
        "warmup_tokens=0",
        "forward_ops=[]",
        "threads=1",
        "plot=false",
        f"output_dir={tmp_path}",
        name="bench_gpu",
    )
    assert list(cfg.batch_sizes) == [1, 16] and list(cfg.num_tokens) == [8]
    assert list(cfg.hf) == ["generate", "generate_mtp"] and list(cfg.prompt_sets) == ["stdlib-heldout"]
    assert cfg.kernel_timings is True  # Triton's interpreter at these sizes: tests/test_bench_kernels.py's business
    cfg.kernel_timings = False
    report = run_bench(cfg)
    names = [r["name"] for r in report["results"]]
    assert names == [
        "hf generate",
        "hf generate(use_mtp)",
        *[f"{mode} {run} b{b}" for b in (1, 16) for mode in ("eager", "graphs") for run in ("none", "mtp k=8")],
    ]
    assert [r["tokens"] for r in report["results"]] == [2 * 3] * 6 + [16 * 3] * 4
    assert report["exactness"]["ok"] and report["exactness"]["runs_compared"] == 6
    assert report["config"]["modes"] == ["eager", "graphs"] and (tmp_path / "bench.json").is_file()
    captured = [r for r in report["results"] if r["name"].startswith("graphs")]
    assert graphs.replays > 0 and all(r["host_reads_per_step"] <= 1 for r in captured)


def test_gpu_session_stages_parse_and_refuse_to_run_off_the_gpu(tmp_path):
    """scripts/gpu_session.sh, the GPU check in one device call: every stage's overrides parse
    and pass the benchmark's own option check (a typo would cost a lent GPU's minutes), and
    `device` refuses with one line, exit 2, where there is no $OUT or no GPU."""
    script = str(ROOT / "scripts" / "gpu_session.sh")
    no_gpu = tmp_path / "bin"  # an nvidia-smi that finds no GPU, also on a machine that has one
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (no_gpu / "nvidia-smi").chmod(0o755)
    path = f"{no_gpu}:{Path(sys.executable).parent}:/usr/bin:/bin"
    env = {"PATH": path, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    check = subprocess.run(["bash", script, "check"], env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr
    stages = [line.split()[1] for line in check.stdout.splitlines()]
    assert stages == ["preset", "profile-k8", "profile-plain", "compiled"]
    refusals = [({}, "$OUT is not set"), ({"OUT": str(tmp_path)}, "no CUDA GPU here")]
    for extra, needle in refusals:
        device = subprocess.run(["bash", script, "device"], env=env | extra, capture_output=True, text=True, timeout=60)
        assert device.returncode == 2
        assert needle in device.stderr and len(device.stderr.strip().splitlines()) == 1
    assert not list(tmp_path.glob("tmp.*"))  # check's scratch folder (mktemp -d) is gone


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["drafters=[none,foo]"], "drafters must be a list drawn from mtp, ngram, none"),
        (["batch_sizes=[0]"], "batch_sizes"),
        (["repeats=0"], "repeats"),
        (["modes=[eager,turbo]"], "modes must be a list drawn from eager, compiled, graphs, compiled_graphs"),
        (["num_tokens=[2,0]"], "num_tokens must be a non-empty list of integers >= 1 and/or auto"),
        (["interleave=prompt"], "interleave must be one of set, batch, got 'prompt'"),
        (["plot=maybe"], "plot must be true or false, got 'maybe'"),
        (["profile_lines=abc"], "profile_lines must be an integer >= 1"),  # was read after the runs
        (["hf=[generate,vllm]"], "hf must be a list drawn from generate, generate_mtp"),
        (["spec.num_tokens=4"], "give num_tokens=[4] instead"),
        (["num_prompts=0"], "num_prompts"),
        (["forward_ops=[compiled]"], "forward_ops"),
        (["prompt_sets=[nope.jsonl]"], "prompts='nope.jsonl' is neither a prompt set"),
        (["kv.block_size=0"], "kv.block_size"),
        (["engine.max_num_batched_tokens=0"], "engine.max_num_batched_tokens"),
        (["prompt_len=200000"], "model limit"),  # the preset's 131072 positions
    ],
)
def test_bad_options_raise_one_sentence(overrides, needle, tmp_path):
    with pytest.raises(ConfigError) as info:
        run_bench(bench_cfg(*DEBUG, f"output_dir={tmp_path}", *overrides))
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_hf_baselines_need_a_checkpoint_and_greedy_decoding():
    with pytest.raises(ConfigError, match="model preset 'inkling-debug' has no path"):
        run_bench(bench_cfg(*DEBUG, "hf=[generate]"))
    with pytest.raises(ConfigError, match="the HF baselines decode greedily"):
        run_bench(bench_cfg(*SHIPPED, "sampler.temperature=1.0"))


def test_the_script_exits_1_when_greedy_outputs_differ(monkeypatch, tmp_path):
    """scripts/bench.py writes everything, then exits 1 when the exactness check failed."""
    import inkfw.bench
    from inkfw.entrypoints import bench_main

    monkeypatch.setattr(inkfw.bench, "run_bench", lambda cfg: {"exactness": {"ok": False}})
    monkeypatch.setattr(sys, "argv", ["bench.py", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"])
    with pytest.raises(SystemExit) as info:
        bench_main()
    assert info.value.code == 1
    monkeypatch.setattr(inkfw.bench, "run_bench", lambda cfg: {"exactness": {"ok": True}})
    bench_main()  # no exit
