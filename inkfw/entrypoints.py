"""The command-line programs as functions: ``scripts/infer.py`` and the console script
``inkfw-infer`` both call :func:`infer_main` (the same for serve, train and bench).

Each ``*_main()`` reads ``sys.argv`` as its script does: arguments Hydra cannot take are
handled first (verbatim ``prompt=`` / ``stop=``, one-line errors for bad overrides and unknown
group options, exit code 2), then the ``@hydra.main`` app composes the config found through
:func:`inkfw.paths.config_dir` (the package's ``inkfw/conf``), so an installed inkfw runs from
any working directory. Hydra writes its run folder under ``runs/`` of the working directory.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from inkfw.cli import EXIT_USER_ERROR, run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir

CONFIG_PATH = str(config_dir())
EXIT_MISMATCH = 1  # scripts/bench.py: greedy outputs of two runs differ


# ----------------------------------------------------------------------------- Hydra apps
# each app imports its run function when it runs: ``inkfw-infer`` need not load Lightning
@hydra.main(config_path=CONFIG_PATH, config_name="infer", version_base="1.3")
def _infer_app(cfg: DictConfig) -> None:
    from inkfw.infer import run_infer

    result = run_user_command(run_infer, cfg)
    if result.get("num_errors"):  # rejected requests were reported one line each; the rest is written
        sys.exit(EXIT_USER_ERROR)


@hydra.main(config_path=CONFIG_PATH, config_name="serve", version_base="1.3")
def _serve_app(cfg: DictConfig) -> None:
    from inkfw.server import run_server

    run_user_command(run_server, cfg)


@hydra.main(config_path=CONFIG_PATH, config_name="train", version_base="1.3")
def _train_app(cfg: DictConfig) -> None:
    from inkfw.train.run import run_train

    run_user_command(run_train, cfg)


@hydra.main(config_path=CONFIG_PATH, config_name="bench", version_base="1.3")
def _bench_app(cfg: DictConfig) -> None:
    from inkfw.bench import run_bench

    report = run_user_command(run_bench, cfg)
    if not report["exactness"]["ok"]:  # greedy outputs differed (listed above); files are written
        sys.exit(EXIT_MISMATCH)


# ----------------------------------------------------------------------------- programs
def infer_main() -> None:
    """``inkfw-infer`` / ``scripts/infer.py``: speculative decoding of prompts (``inkfw/conf/infer.yaml``)."""
    check_command_line("infer", verbatim=True)  # prompt=/stop= verbatim; bad overrides: one error line, exit 2
    _infer_app()


def serve_main() -> None:
    """``inkfw-serve`` / ``scripts/serve.py``: the OpenAI-compatible server (``inkfw/conf/serve.yaml``)."""
    check_command_line("serve")  # bad overrides: one error line, exit 2
    _serve_app()


def train_main() -> None:
    """``inkfw-train`` / ``scripts/train.py``: MTP depths or pretraining (``inkfw/conf/train.yaml``)."""
    check_command_line("train")
    _train_app()


def bench_main() -> None:
    """``inkfw-bench`` / ``scripts/bench.py``: the benchmark (``inkfw/conf/bench.yaml``; ``--config-name bench_gpu``)."""
    check_command_line("bench")
    _bench_app()
