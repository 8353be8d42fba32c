"""Acceptance of a checkpoint's MTP depths on a prompt set at k = 1..D (inkfw/conf/eval_acceptance.yaml)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir


@hydra.main(config_path=str(config_dir()), config_name="eval_acceptance", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from inkfw.eval_acceptance import run_eval_acceptance

    run_user_command(run_eval_acceptance, cfg)


if __name__ == "__main__":
    check_command_line("eval_acceptance")  # bad overrides: one error line, exit 2
    main()
