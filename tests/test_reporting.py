"""inkfw.reporting: statistics collected from engine state, and their renderings (tables,
Markdown, PNG, atomic JSON), checked without running a model."""

from __future__ import annotations

import io
import json
import os
from collections import Counter
from types import SimpleNamespace

import pytest
from rich.console import Console

from inkfw.errors import ConfigError
from inkfw.reporting import (
    infer_table,
    output_file,
    overhead_markdown,
    overhead_plot,
    overhead_table,
    print_requests,
    request_record,
    run_metrics,
    write_json_atomic,
    write_text_atomic,
)
from inkfw.speculative.engine import Request, StepTimes
from inkfw.speculative.metrics import SpecMetrics
from inkfw.speculative.sampling import SamplingParams


def finished_request(
    rid: int,
    prompt: list[int],
    output: list[int],
    steps: int,
    drafted: int,
    accepted: int,
    arrival: float = 10.0,
    first_token: float | None = 10.5,
) -> Request:
    r = Request(
        rid,
        prompt,
        SamplingParams(),
        max_new_tokens=len(output),
        token_ids=prompt + output,
        status="finished",
        finish_reason="length",
        text=" ".join(map(str, output)),
        num_verify_steps=steps,
        num_draft_tokens=drafted,
        num_accepted_tokens=accepted,
        arrival_time=arrival,
        first_token_time=first_token,
    )
    return r


def rendered(renderable, width: int = 400) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def bench_row(drafter: str, batch: int, **over) -> dict:
    row = {
        "prompt_set": "humaneval",
        "name": f"eager {drafter}{' k=4' if drafter == 'mtp' else ''} b{batch}",
        "drafter": drafter,
        "batch_size": batch,
        "num_draft_tokens": 4 if drafter == "mtp" else 0,
        "wall_s": 2.0,
        "tokens": 100,
        "tokens_per_s": 50.0,
        "num_steps": 40,
        "step_s": 1.1,
        "forward_s": 1.0,
        "overhead_ratio": 1.1,
        "overhead_ratio_per_repeat": [1.08, 1.12],
        "step_ms": 27.5,
        "decode_steps": 38,
        "decode_step_ms": 24.5,
        "prompt_steps": 2,
        "prompt_s": 0.169,
        "non_forward_ms_per_step": 2.5,
        "draft_s": 0.3,
        "verify_s": 0.7,
        "bookkeeping_s": 0.1,
        "draft_forward_s": 0.25,
        "verify_forward_s": 0.6,
        "draft_non_forward_s": 0.05,
        "verify_non_forward_s": 0.1,
        "cache_in_forward_s": None,
        "overhead_ratio_model_only": None,
        "mean_acceptance_length": 1.5,
        "draft_acceptance_rate": 0.125,
        "kv_bytes": 3 * 2**20,
    }
    row.update(over)
    return row


# ------------------------------------------------------------------ statistics
def test_request_record_of_a_finished_and_a_rejected_request():
    r = finished_request(0, [5, 6, 7], [8, 9], steps=2, drafted=8, accepted=1)
    rec = request_record(r, 1, prompt="hi")
    assert rec["prompt_token_ids"] == [5, 6, 7] and rec["token_ids"] == [8, 9] and rec["text"] == "8 9"
    assert (rec["num_verify_steps"], rec["num_draft_tokens"], rec["num_accepted_tokens"]) == (2, 8, 1)
    assert rec["finish_reason"] == "length" and rec["error"] is None and rec["prompt"] == "hi"
    assert rec["time_to_first_token_s"] == pytest.approx(0.5)
    rejected = request_record(None, 2, prompt_token_ids=[1, 2], error="bad line")
    assert rejected["finish_reason"] == "error" and rejected["error"] == "bad line"
    assert rejected["prompt_token_ids"] == [1, 2] and rejected["token_ids"] == [] and rejected["num_verify_steps"] == 0
    failed = request_record(r, 3, error="pool too small")  # the engine failed it while running
    assert failed["finish_reason"] == "error" and failed["token_ids"] == [8, 9]


def test_run_metrics_from_engine_state():
    metrics = SpecMetrics()
    metrics.record([4, 4], [2, 0])
    metrics.record([4], [4])
    times = StepTimes(
        draft_s=1.0, verify_s=2.0, bookkeeping_s=1.0, forward_s=3.0, num_steps=2, prompt_steps=1, prompt_s=0.5
    )
    engine = SimpleNamespace(
        metrics=metrics,
        times=times,
        drafter=SimpleNamespace(num_tokens=4, num_depths=4),
        warmup_s=1.5,
        adaptive=object(),  # spec.num_tokens=auto
        k_chosen=Counter({2: 3, 0: 1}),
        depths_admitted=Counter({4: 1, 0: 2, 2: 1}),
    )
    reqs = [
        finished_request(0, [1], [2, 3, 4], 2, 8, 2, first_token=11.0),
        finished_request(1, [1], [5, 6, 7, 8, 9], 1, 4, 4, first_token=None),
    ]
    m = run_metrics(engine, reqs, wall_s=2.0, drafter="mtp")
    assert (m["drafter"], m["num_tokens"], m["mtp_depths"], m["num_requests"]) == ("mtp", 4, 4, 2)
    assert m["num_generated_tokens"] == 8 and m["tokens_per_s"] == pytest.approx(4.0)
    assert m["num_verify_steps"] == 3 and m["num_draft_tokens"] == 12 and m["num_accepted_tokens"] == 6
    assert m["mean_acceptance_length"] == pytest.approx(1 + 6 / 3)
    assert m["mean_acceptance_length"] == pytest.approx(1 + sum(m["acceptance_per_position"]))
    assert m["time_to_first_token_s"] == pytest.approx(1.0)  # the request without a first token is left out
    assert m["step_times"] == {
        "draft_s": 1.0,
        "verify_s": 2.0,
        "bookkeeping_s": 1.0,
        "forward_s": 3.0,
        "num_steps": 2,
        "prompt_steps": 1,
        "prompt_s": 0.5,
    }
    assert m["forward_share"] == pytest.approx(0.75)
    assert m["warmup_s"] == 1.5 and m["chosen_k"] == {"0": 1, "2": 3}
    assert list(m["depths_admitted"].items()) == [("0", 2), ("2", 1), ("4", 1)]  # in order of depths
    json.dumps(m)  # plain data, ready for output.json
    fixed = run_metrics(SimpleNamespace(**{**vars(engine), "adaptive": None}), reqs, 2.0, "mtp")
    assert fixed["chosen_k"] is None and fixed["depths_admitted"] is None
    assert run_metrics(engine, [], wall_s=0.0, drafter="mtp")["tokens_per_s"] == 0.0


# ------------------------------------------------------------------ renderings
def test_infer_table_rows():
    m = {
        "drafter": "mtp",
        "num_tokens": 4,
        "mtp_depths": 2,
        "num_requests": 3,
        "num_generated_tokens": 30,
        "num_verify_steps": 12,
        "num_draft_tokens": 48,
        "num_accepted_tokens": 6,
        "mean_acceptance_length": 1.5,
        "acceptance_per_position": [0.25, 0.25],
        "draft_acceptance_rate": 0.125,
        "tokens_per_s": 12.34,
        "time_to_first_token_s": None,
        "forward_share": 0.8,
        "num_errors": 2,
        "step_times": {
            "draft_s": 1.0,
            "verify_s": 3.0,
            "bookkeeping_s": 0.0,
            "forward_s": 3.2,
            "num_steps": 9,
            "prompt_steps": 1,
            "prompt_s": 0.8,
        },
    }
    text = rendered(infer_table(m, "checkpoints/x"))
    assert "inkfw infer" in text and "checkpoints/x" in text
    assert "mtp (k=4, D=2)" in text and "3 (+2 rejected)" in text
    assert "1.500" in text and "25.0% 25.0%" in text and "48 / 6 (12.5%)" in text and "12.3" in text
    assert "1.000 s (25%)" in text and "3.000 s (75%)" in text and "80%" in text
    assert "mean decode step" in text and "400.00 ms (8 steps)" in text  # (4.0 - 0.8) s over 9 - 1 steps
    assert "0.800 s (1 step)" in text
    assert "k chosen" not in text and "warm-up" not in text  # neither auto nor warmed up
    assert "depths (requests)" not in text
    auto = {**m, "chosen_k": {"0": 3, "2": 5}, "depths_admitted": {"0": 1, "2": 6}, "warmup_s": 10.46}
    text = rendered(infer_table(auto, "x"))
    assert "0:3 2:5" in text and "10.5 s" in text and "depths (requests)" in text and "0:1 2:6" in text
    m_none = {
        **m,
        "drafter": "none",
        "num_tokens": 0,
        "mtp_depths": 0,
        "num_errors": 0,
        "chosen_k": None,
        "warmup_s": 0.0,
    }
    text = rendered(infer_table(m_none, "x"))
    assert "(k=" not in text and "rejected" not in text and "k chosen" not in text and "warm-up" not in text


def test_print_requests_text_ids_and_rejections():
    records = [
        request_record(finished_request(0, [5, 6], [7, 8, 9], 2, 8, 1), 1, prompt="p: "),
        request_record(None, 2, error="not valid JSON"),
    ]
    console = Console(width=200, record=True, file=io.StringIO())
    print_requests(console, records, show_text=True)
    text = console.export_text()
    assert "request 1: 2 prompt + 3 new tokens (length), 2 steps, acceptance 1.50" in text
    assert "p: 7 8 9" in text and "request 2 rejected: not valid JSON" in text
    print_requests(console, records[:1], show_text=False)
    assert "ids: [7, 8, 9]" in console.export_text()


def test_overhead_markdown_and_table_columns():
    rows = [bench_row("none", 1), bench_row("mtp", 1, overhead_ratio=1.3)]
    md = overhead_markdown(rows).strip().splitlines()
    assert len(md) == 4 and all(line.count("|") == md[0].count("|") for line in md)
    assert md[2].startswith(
        "| humaneval | eager none b1 | 2.00 | 50.0 | 40 | 27.5 | 24.5 | 2 x 84.5 | 25.0 | **1.100** | 1.080-1.120 |"
    )
    assert "| 0 |" in overhead_markdown([bench_row("none", 1, prompt_steps=0, prompt_s=0.0)])
    assert "cache ms" not in md[0]
    cached = overhead_markdown([bench_row("none", 1, cache_in_forward_s=0.2, overhead_ratio_model_only=1.375)])
    assert "model-only overhead" in cached and "| 5.00 | 1.375 |" in cached
    table = overhead_table(rows)
    assert len(table.columns) == 15 and table.row_count == 2
    text = rendered(table)
    assert "humaneval eager mtp k=4 b1" in text and "1.080-1.120" in text and "3.0" in text
    assert "cProfile" in rendered(overhead_table(rows, profiled=True))
    assert (
        len(overhead_table([bench_row("none", 1, cache_in_forward_s=0.2, overhead_ratio_model_only=1.375)]).columns)
        == 17
    )


def test_overhead_plot_writes_a_png(tmp_path):
    path = tmp_path / "overhead.png"
    assert overhead_plot([bench_row("none", 1), bench_row("mtp", 1)], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ files
def test_write_json_atomic_replaces_and_leaves_nothing_behind(tmp_path):
    path = tmp_path / "a" / "b.json"
    write_json_atomic(path, {"x": 1})
    write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2} and os.listdir(path.parent) == ["b.json"]
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"^output_dir=.*cannot write") as info:
        write_text_atomic(tmp_path / "file" / "x.md", "text", "output_dir")  # its folder is a file
    assert "\n" not in str(info.value)


def test_output_file_checks_the_path_first(tmp_path):
    assert output_file(None, "output.json") is None and output_file("", "output.json") is None
    path = output_file(str(tmp_path / "new" / "dir" / "o.json"), "output.json")
    assert path.parent.is_dir() and not path.exists()
    with pytest.raises(ConfigError, match="output.json=.* is a directory"):
        output_file(str(tmp_path), "output.json")
