"""Train MTP depths on a frozen Inkling backbone, or a small Inkling from scratch."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import check_group_choices, run_user_command
from inkfw.paths import config_dir
from inkfw.train.run import run_train


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_train, cfg)


if __name__ == "__main__":
    check_group_choices(config_dir())
    main()
