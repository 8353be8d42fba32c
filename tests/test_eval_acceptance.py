"""scripts/eval_acceptance.py: acceptance at k = 1..D and the depth-0 reuse baseline, as a table,
JSON, a PNG and an offline W&B run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from inkfw.errors import ConfigError
from inkfw.eval_acceptance import acceptance_runs, humaneval_prompts, load_prompts, run_eval_acceptance
from inkfw.paths import config_dir

ROOT = Path(__file__).resolve().parents[1]


def eval_config(*overrides: str):
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("eval_acceptance", overrides=list(overrides))


def test_script_reports_every_k_and_the_baseline(tmp_path):
    D = 2
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "eval_acceptance.py"),
            "prompts=stdlib-heldout",
            "num_prompts=2",
            "max_new_tokens=8",
            f"mtp.depths={D}",
            f"output_dir={tmp_path}",
            f"hydra.run.dir={tmp_path}/hydra",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "200"},  # the table unwrapped
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((tmp_path / "acceptance.json").read_text())
    assert result["num_prompts"] == 2 and result["mtp_depths"] == D and result["temperature"] == 0.0
    assert [row["num_tokens"] for row in result["rows"]] == list(range(1, D + 1))
    for row in result["rows"] + [result["baseline"]]:
        assert len(row["acceptance_per_position"]) == row["num_tokens"]
        assert row["mean_acceptance_length"] == pytest.approx(1 + sum(row["acceptance_per_position"]), abs=1e-12)
        assert row["num_generated_tokens"] == 2 * 8 and row["tokens_per_s"] > 0
    assert all(row["mtp_depths"] == D for row in result["rows"])
    assert result["baseline"]["mtp_depths"] == 1 and result["baseline"]["num_tokens"] == D
    assert result["rows"][0]["mean_acceptance_length"] > 1  # the shipped depths accept something
    assert (tmp_path / "acceptance.png").stat().st_size > 0
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    assert "mean acceptance length" in r.stdout and "k=2" in r.stdout


def test_humaneval_prompts_come_from_the_package_data_file():
    prompts = humaneval_prompts()
    assert len(prompts) == 164
    assert prompts[0].startswith("from typing import List") and "def has_close_elements" in prompts[0]


def test_prompt_files_and_their_errors(tmp_path):
    ids_file = tmp_path / "ids.jsonl"
    ids_file.write_text('{"token_ids": [5, 6, 7]}\n{"token_ids": [8]}\n')
    assert load_prompts(str(ids_file), tokenizer=None) == [[5, 6, 7], [8]]
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_prompts("stdlib-heldout", tokenizer=None)
    with pytest.raises(ConfigError, match="neither a prompt set"):
        load_prompts(str(tmp_path / "missing.jsonl"), tokenizer=None)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(ConfigError, match="must be a string"):
        load_prompts(str(bad), tokenizer=None)


def test_runs_are_k_1_to_d_then_depth0_reuse():
    runs = acceptance_runs(3, baseline=True)
    assert [(r.depths, r.num_tokens) for r in runs] == [(3, 1), (3, 2), (3, 3), (1, 3)]
    assert [(r.depths, r.num_tokens) for r in acceptance_runs(2, baseline=False)] == [(2, 1), (2, 2)]


@pytest.mark.parametrize(
    "override, message",
    [
        ("mtp.depths=9", "mtp.depths must be an integer in [1, 8]"),
        ("num_prompts=0", "num_prompts"),
        ("report_to=tensorboard", "report_to must be one of"),
        ("max_new_tokens=0", "max_new_tokens"),
        ("baseline=maybe", "baseline must be true or false, got 'maybe'"),
    ],
)
def test_bad_options_are_one_sentence(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        run_eval_acceptance(eval_config("report_to=none", f"output_dir={tmp_path}", override))
