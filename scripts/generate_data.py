"""Target-generated training data: the target continues prompts cut from the training split."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.train.generate import run_generate_data


@hydra.main(config_path=str(config_dir()), config_name="generate_data", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_generate_data, cfg)


if __name__ == "__main__":
    check_command_line("generate_data")  # bad overrides: one error line, exit 2
    main()
