"""Write held-out prompts (cut from the validation split only) as JSON lines for scripts/infer.py."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.train.data import write_heldout_prompts


@hydra.main(config_path=str(config_dir()), config_name="heldout_prompts", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(write_heldout_prompts, cfg)


if __name__ == "__main__":
    check_command_line("heldout_prompts")  # bad overrides: one error line, exit 2
    main()
