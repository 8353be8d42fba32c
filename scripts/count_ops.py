"""Top-level aten op count and eager wall time of a 1-token forward (shipped checkpoint by default)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.profiling import report_one_token_ops


@hydra.main(config_path=str(config_dir()), config_name="count_ops", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(report_one_token_ops, cfg)


if __name__ == "__main__":
    check_command_line("count_ops")  # bad overrides: one error line, exit 2
    main()
