"""2-process DDP on CPU (gloo, trainer=ddp) trains the same depths as one process on the same global batch."""

from __future__ import annotations

import torch
from ddp_worker import initial_depths, trained


def test_ddp_matches_single_process():
    single, ddp = trained("single")["depths"], trained("ddp")["depths"]
    init = initial_depths()
    assert single.keys() == ddp.keys()
    moved = [k for k in single if not torch.equal(single[k], init[k])]
    assert moved, "training changed nothing"
    for k in single:
        torch.testing.assert_close(
            ddp[k], single[k], atol=5e-5, rtol=1e-4
        )  # Adam amplifies float noise; a wrong batch is off by ~1e-2
