"""Speculative decoding: multi-depth MTP (or n-gram, or no) drafts verified by the target model."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from inkfw.cli import EXIT_USER_ERROR, check_group_choices, run_user_command
from inkfw.infer import run_infer

CONF = Path(__file__).resolve().parent.parent / "conf"


@hydra.main(config_path="../conf", config_name="infer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    result = run_user_command(run_infer, cfg)
    if result.get("num_errors"):  # rejected requests were reported one line each; the rest is written
        sys.exit(EXIT_USER_ERROR)


if __name__ == "__main__":
    from inkfw.cli_args import prepare_argv

    prepare_argv(CONF, "infer")  # prompt=/stop= verbatim; bad overrides: one error line, exit 2
    check_group_choices(CONF)
    main()
