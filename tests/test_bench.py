"""scripts/bench.py's run on the random-init debug preset, one repeat: the report holds every
configuration with sane timings, the drafters agree on greedy outputs, and the files are written.

Only the shape and consistency of the numbers are checked, never a speed.
"""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_dir

from inkfw.bench import run_bench
from inkfw.errors import ConfigError
from inkfw.paths import config_dir

CONF = config_dir()
TINY = [
    "model=inkling-debug",
    "batch_sizes=[1,2]",
    "max_new_tokens=5",
    "prompt_len=6",
    "warmup_tokens=2",
    "repeats=1",
    "plot=true",
]


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    before = torch.get_num_threads()  # the benchmark sets threads=1
    yield
    torch.set_num_threads(before)


def bench_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("bench", overrides=[*TINY, *overrides])


def test_one_repeat_on_the_debug_preset(tmp_path):
    report = run_bench(bench_cfg(f"output_dir={tmp_path}", "cache_time=true"))
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["results"] == report["results"]
    assert written["config"]["spec"]["num_tokens"] is None and written["config"]["kv"]["block_size"] == 16
    rows = {(r["drafter"], r["batch_size"]): r for r in written["results"]}
    assert sorted(rows) == [("mtp", 1), ("mtp", 2), ("none", 1), ("none", 2)]
    for (drafter, batch), r in rows.items():
        assert r["tokens"] == batch * 5  # ignore_eos: every request decodes max_new_tokens
        assert r["wall_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])
        assert r["num_steps"] >= 5 and r["step_s"] > r["forward_s"] > 0
        assert r["overhead_ratio"] == pytest.approx(r["step_s"] / r["forward_s"]) and r["overhead_ratio"] > 1
        assert r["overhead_ratio_per_repeat"] == [pytest.approx(r["overhead_ratio"])]
        # the phases' forwards (from the engine's observer hooks) add up to the engine's forward time
        assert r["verify_forward_s"] + r["draft_forward_s"] == pytest.approx(r["forward_s"], rel=1e-6)
        assert 0 < r["verify_forward_s"] <= r["verify_s"] and 0 <= r["draft_forward_s"] <= r["draft_s"]
        assert (r["draft_forward_s"] > 0) == (drafter == "mtp")
        assert r["num_draft_tokens"] == (4 if drafter == "mtp" else 0)  # k = D = the 4 depths that ship
        assert 1.0 <= r["mean_acceptance_length"] <= 1 + r["num_draft_tokens"]
        assert 0 < r["cache_in_forward_s"] < r["forward_s"]  # the paged cache's timing hook
        assert r["overhead_ratio_model_only"] > r["overhead_ratio"]
        assert r["greedy_output_mismatches"] == 0  # lossless: greedy outputs of none and mtp are equal
    for batch in (1, 2):  # the MTP depths' pools come on top of the target's
        assert rows[("mtp", batch)]["kv_bytes"] > rows[("none", batch)]["kv_bytes"] > 0
    markdown = (tmp_path / "bench.md").read_text()
    assert "| mtp (k=4) | 2 |" in markdown and "model-only overhead" in markdown
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_sampled_outputs_differ_and_the_profile_is_written(tmp_path):
    """Negative control of the greedy comparison (sampling draws differently per drafter), and
    profile=true pausing the profiler in forwards through the observer hooks."""
    report = run_bench(
        bench_cfg(
            "batch_sizes=[2]",
            f"output_dir={tmp_path}",
            "plot=false",
            "profile=true",
            "sampler.temperature=1.0",
            "sampler.seed=0",
            "max_new_tokens=8",
        )
    )
    assert all(r["greedy_output_mismatches"] > 0 for r in report["results"])
    for drafter in ("none", "mtp"):
        text = (tmp_path / f"profile-{drafter}-b2.txt").read_text()
        assert text.startswith(f"{drafter} b=2 (profiler on)") and "Top functions by own time" in text
        assert "inkfw/speculative/engine.py" in text  # the engine's own work is profiled
    assert not (tmp_path / "bench.png").exists()


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["drafters=[none,foo]"], "drafters must be a list drawn from mtp, ngram, none"),
        (["batch_sizes=[0]"], "batch_sizes"),
        (["repeats=0"], "repeats"),
        (["kv.block_size=0"], "kv.block_size"),
        (["spec.num_tokens=0"], "spec.num_tokens"),
        (["engine.max_num_batched_tokens=0"], "engine.max_num_batched_tokens"),
        (["prompt_len=200000"], "model limit"),  # the preset's 131072 positions
    ],
)
def test_bad_options_raise_one_sentence(overrides, needle, tmp_path):
    with pytest.raises(ConfigError) as info:
        run_bench(bench_cfg(f"output_dir={tmp_path}", *overrides))
    assert needle in str(info.value) and "\n" not in str(info.value)
