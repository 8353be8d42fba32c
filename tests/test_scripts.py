"""Entry points: the smoke run works, bad input gives one line on stderr and exit code != 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / script), *overrides,
                           "hydra.run.dir=" + str(cwd / "hydra"), "hydra.output_subdir=null"],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


def test_smoke_run_succeeds(tmp_path):
    out = run("smoke.py", "max_new_tokens=8", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "cached greedy == uncached greedy" in out.stdout and "yes" in out.stdout


@pytest.mark.parametrize("overrides, needle", [
    (["model=inkling", "model.path=/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["mtp.depths=9"], "mtp.depths=9"),
    (["max_new_tokens=0"], "max_new_tokens"),
    (["dtype=float64"], "dtype"),
    (["mtp.embed_source=normed"], "embed_source"),
    (["prompt_token_ids=[1,2,100000]"], "prompt token ids"),
])
def test_bad_input_gives_one_line_no_traceback(tmp_path, overrides, needle):
    out = run("smoke.py", *overrides, cwd=tmp_path)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in out.stderr


def test_debug_true_shows_traceback(tmp_path):
    out = run("smoke.py", "model=inkling", "model.path=/nonexistent/ckpt", "debug=true", cwd=tmp_path)
    assert out.returncode != 0
    assert "Traceback" in out.stderr or "CheckpointError" in out.stderr


def test_corrupt_checkpoint_via_script(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"model_type": "inkling_model", "num_hidden_layers": 2}')
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    out = run("smoke.py", "model=inkling", f"model.path={ckpt}", cwd=tmp_path)
    assert out.returncode != 0
    assert "model.safetensors" in out.stderr and "Traceback" not in out.stderr


def test_count_params_prints_table(tmp_path):
    out = run("count_params.py", "model=inkling-release", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "947,025,547,842" in out.stdout and "41,055,883,842" in out.stdout
