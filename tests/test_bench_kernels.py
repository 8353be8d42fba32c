"""inkfw.bench.kernels: every Triton kernel against its torch reference and the verify forward with
both kernel backends, on the CPU (the Triton side in Triton's interpreter), and its place in the
benchmark (options, ``bench.json``'s ``kernels``, the tables). Only the rows' structure and the
agreement of the backends are checked, never a speed."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

import inkfw.kernels
from helpers.bench import bench_cfg, restore_threads  # noqa: F401
from inkfw.bench import run_bench
from inkfw.bench.kernels import compare, kernel_timings, op_cases, time_case, verify_row
from inkfw.errors import ConfigError
from inkfw.kernels import implementation
from inkfw.reporting import kernel_markdown, kernel_table

pytestmark = pytest.mark.kernel

OPS_ONCE = ["greedy_accept", "rejection_sample", "prepare_draft_spans", "mtp_depth_input"]
CACHE_OPS = [
    "paged_span_attention[sliding]",
    "paged_span_attention[global]",
    "cached_short_conv[k,v]",
    "cached_short_conv[hidden]",
]


def test_every_op_and_the_verify_forward_agree_across_backends(model, cfg):
    rows = kernel_timings(model, "cpu", [1, 2], [40], repeats=1, warmup=0, prefill_each=False)
    keys = [(r["op"], r["batch"], r["context"]) for r in rows]
    expected = [(op, b, 40) for b in (1, 2) for op in CACHE_OPS] + [(op, b, None) for b in (1, 2) for op in OPS_ONCE]
    expected += [("verify_forward", b, 40) for b in (1, 2)]
    assert sorted(keys, key=str) == sorted(expected, key=str) and len(keys) == len(set(keys))
    for r in rows:
        assert r["agree"] is True and 0.0 <= r["max_abs_diff"] < 1e-4, r  # fp32: the interpreter is exact-ish
        assert r["torch_ms"] > 0 and r["triton_ms"] > 0
        assert r["speedup"] == pytest.approx(r["torch_ms"] / r["triton_ms"])
    shapes = {r["op"]: r["shape"] for r in rows}
    # shaped like the model: heads, head dims, extents, window, hidden, vocab, conv kernel; span 9
    assert shapes["paged_span_attention[global]"] == (
        f"T=9 Hq={cfg.num_heads} Hkv={cfg.num_kv_heads} D={cfg.head_dim} E={cfg.rel_extent}"
    )
    assert shapes["paged_span_attention[sliding]"] == (
        f"T=9 Hq={cfg.swa_num_heads} Hkv={cfg.swa_num_kv_heads} D={cfg.swa_head_dim} E={cfg.sliding_window} "
        f"window={cfg.sliding_window}"
    )
    assert shapes["cached_short_conv[hidden]"] == f"S=1 T=9 C={cfg.hidden_size} K={cfg.conv_kernel_size}"
    assert shapes["cached_short_conv[k,v]"].startswith("S=2 T=9 ")
    assert shapes["greedy_accept"] == f"k=8 V={cfg.logits_vocab_size}"
    assert shapes["prepare_draft_spans"] == f"P-1={min(cfg.mtp.num_nextn_predict_layers, 8) - 1} width=9 H=32"
    assert shapes["verify_forward"] == f"T=9 {cfg.num_layers} layers"


def test_compare_flags_float_and_integer_differences():
    x = torch.linspace(-1, 1, 10)
    ids = torch.arange(5)
    assert compare((x, ids), (x.clone(), ids.clone())) == (True, 0.0)
    agree, diff = compare((x, ids), (x + 0.5, ids))
    assert not agree and diff == pytest.approx(0.5)
    assert compare((x, ids), (x, ids.flip(0)))[0] is False
    assert compare(x, x[:5])[0] is False  # shapes differ


def test_a_wrong_kernel_is_reported_as_disagreeing(model, monkeypatch):
    """Each op's check compares what both implementations return and write: a 'Triton' side that
    returns the reference's result plus one (or writes a wrong tail) disagrees."""
    import inkfw.bench.kernels as bench_kernels

    def off_by_one(op: str, backend: str):
        fn = implementation(op, "torch")
        if backend == "torch":
            return fn

        def wrong(*args, **kwargs):
            out = fn(*args, **kwargs)
            if op == "prepare_draft_spans":
                args[0].add_(1.0)  # the tail it writes in place
                return out
            return tuple(o + 1 for o in out) if isinstance(out, tuple) else out + 1

        return wrong

    monkeypatch.setattr(bench_kernels, "implementation", off_by_one)
    cases = op_cases(model, 2, [40], 9, 16, torch.device("cpu"))
    assert {c.op for c in cases} == set(inkfw.kernels.OPS)
    for case in cases:
        row = time_case(case, repeats=1, warmup=0, device=torch.device("cpu"))
        assert row["agree"] is False, case.name


def test_the_greedy_check_sees_a_wrong_fused_attention(model, monkeypatch):
    """The verify forward with the fused path (the references standing in for the kernels, each
    cache prefilled on its own backend) agrees with the modules; negated attention outputs do not."""
    monkeypatch.setattr(inkfw.kernels, "implementation", lambda op, backend: implementation(op, "torch"))
    row = verify_row(model, 2, 40, 9, 16, repeats=1, warmup=0, prefill_each=True)
    assert row["agree"] is True and row["max_abs_diff"] < 1e-4

    def negated(op: str, backend: str):
        fn = implementation(op, "torch")
        if op != "paged_span_attention" or backend == "torch":
            return fn
        return lambda *args, **kwargs: -fn(*args, **kwargs)

    monkeypatch.setattr(inkfw.kernels, "implementation", negated)
    row = verify_row(model, 2, 40, 9, 16, repeats=1, warmup=0, prefill_each=True)
    assert row["agree"] is False and row["max_abs_diff"] > 1e-2


def test_the_benchmark_reports_kernels(tmp_path):
    assert bench_cfg().kernel_timings is False  # off unless asked for
    gpu = bench_cfg(name="bench_gpu")
    assert gpu.kernel_timings is True
    assert list(gpu.kernel_batch_sizes) == [1, 16] and list(gpu.kernel_contexts) == [512, 8192]
    report = run_bench(
        bench_cfg(
            "model=inkling-debug",
            "prompt_sets=[random]",
            "hf=[]",
            "modes=[eager]",
            "drafters=[none]",
            "batch_sizes=[1]",
            "num_prompts=1",
            "prompt_len=4",
            "max_new_tokens=2",
            "warmup_tokens=0",
            "forward_ops=[]",
            "forward_repeats=1",
            "threads=1",
            "plot=false",
            "kernel_timings=true",
            "kernel_batch_sizes=[1]",
            "kernel_contexts=[20]",
            f"output_dir={tmp_path}",
        )
    )
    section = report["kernels"]
    assert section["span"] == 9 and section["repeats"] == 1 and section["interpreter"] is True
    assert section["agree"] is True and section["greedy_agree"] is True
    assert {(r["op"], r["context"]) for r in section["rows"]} >= {("verify_forward", 20), ("greedy_accept", None)}
    assert all(r["batch"] == 1 for r in section["rows"])
    assert json.loads((tmp_path / "bench.json").read_text())["kernels"]["rows"] == section["rows"]
    markdown = (tmp_path / "bench.md").read_text()
    assert "## Kernels" in markdown and markdown.count("| verify_forward | T=9 4 layers | 1 | 20 |") == 1
    assert kernel_markdown(section) in markdown
    console = Console(file=io.StringIO(), width=220)
    console.print(kernel_table(section))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "paged_span_attention[global]" in text and "interpreter" in text


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["kernel_timings=maybe"], "kernel_timings must be true or false"),
        (["kernel_timings=true", "kernel_contexts=[0]"], "kernel_contexts must be a non-empty list of integers"),
        (["kernel_timings=true", "kernel_batch_sizes=[]"], "kernel_batch_sizes must be a non-empty list"),
    ],
)
def test_bad_kernel_options_raise_one_sentence(overrides, needle):
    cfg = bench_cfg("model=inkling-debug", "prompt_sets=[random]", "hf=[]", *overrides)
    with pytest.raises(ConfigError) as info:
        run_bench(cfg)
    assert needle in str(info.value) and "\n" not in str(info.value)
