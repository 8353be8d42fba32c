"""Shared test fixtures. Helpers live in the ``helpers`` package (``tests/helpers``)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton kernels run on CPU tensors in Triton's interpreter; it is chosen when a kernel is defined,
# so it must be set before inkfw.kernels' modules are imported (tests run them in fp32)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers.models import randomize_, tiny_config
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.model import InklingLM


@pytest.fixture
def cfg() -> InklingConfig:
    return tiny_config()


@pytest.fixture
def model(cfg) -> InklingLM:
    torch.manual_seed(0)
    return randomize_(InklingLM(cfg, mtp_depths=cfg.mtp.num_nextn_predict_layers)).eval()


# tiny models: one intra-op thread is faster and immune to other jobs on a shared machine
torch.set_num_threads(1)
