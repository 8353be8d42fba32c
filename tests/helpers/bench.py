"""Shared by the benchmark tests: the composed bench configs, and a fixture that undoes the
benchmark's thread setting."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir

from inkfw.paths import config_dir


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    """Test modules import this fixture to make it autouse there: the benchmark sets threads."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def bench_cfg(*overrides: str, name: str = "bench"):
    """``inkfw/conf/<name>.yaml`` composed with ``overrides``."""
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(name, overrides=list(overrides))
