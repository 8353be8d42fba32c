"""2-process DDP on CPU (gloo) trains the same depths as one process on the same global batch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"


def _train(devices: int, out: Path) -> dict[str, torch.Tensor]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(WORKER), str(devices), str(out)], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(out)


def test_ddp_matches_single_process(tmp_path):
    single = _train(1, tmp_path / "single.pt")
    ddp = _train(2, tmp_path / "ddp.pt")
    init = _train_init()
    assert single.keys() == ddp.keys()
    moved = [k for k in single if not torch.equal(single[k], init[k])]
    assert moved, "training changed nothing"
    for k in single:
        torch.testing.assert_close(
            ddp[k], single[k], atol=5e-5, rtol=1e-4
        )  # Adam amplifies float noise; a wrong batch is off by ~1e-2


def _train_init() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(WORKER.parent))
    from helpers.models import randomize_, tiny_config
    from inkfw.models.inkling.model import InklingLM

    torch.manual_seed(0)
    model = randomize_(InklingLM(tiny_config(), mtp_depths=2))
    return {k: v for k, v in model.state_dict().items() if k.startswith("mtp.")}
