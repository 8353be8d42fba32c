"""Model smoke run: cached greedy decoding checked against an uncached forward, plus MTP drafts."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.smoke import smoke_run


@hydra.main(config_path=str(config_dir()), config_name="smoke", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(smoke_run, cfg)


if __name__ == "__main__":
    check_command_line("smoke")  # bad overrides: one error line, exit 2
    main()
