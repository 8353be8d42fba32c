"""Print total and active parameter counts of a model preset, built on the meta device."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.presets import report_parameters


@hydra.main(config_path=str(config_dir()), config_name="count_params", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(report_parameters, cfg)


if __name__ == "__main__":
    check_command_line("count_params")  # bad overrides: one error line, exit 2
    main()
