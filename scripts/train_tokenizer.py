"""Train a byte-level BPE tokenizer.json on a corpus (default: the Python standard library)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.train.tokenizer import run_train_tokenizer


@hydra.main(config_path=str(config_dir()), config_name="train_tokenizer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_train_tokenizer, cfg)


if __name__ == "__main__":
    check_command_line("train_tokenizer")  # bad overrides: one error line, exit 2
    main()
