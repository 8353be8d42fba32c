"""Store the backbone's final hidden states of a corpus, for training MTP depths from them
(``scripts/train.py data=hidden data.path=DIR``; :mod:`inkfw.train.hidden`)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir


@hydra.main(config_path=str(config_dir()), config_name="dump_hidden", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from inkfw.train.hidden import run_dump_hidden  # loads torch and Lightning: after --help

    run_user_command(run_dump_hidden, cfg)


if __name__ == "__main__":
    check_command_line("dump_hidden")  # bad overrides: one error line, exit 2
    main()
