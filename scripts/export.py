"""Export a training checkpoint (Lightning .ckpt) in the release layout; the checkpoint holds the run's config."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.train.run import run_export


@hydra.main(config_path=str(config_dir()), config_name="export", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_export, cfg)


if __name__ == "__main__":
    check_command_line("export")  # bad overrides: one error line, exit 2
    main()
