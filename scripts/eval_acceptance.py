"""Acceptance of a checkpoint's MTP depths on a prompt set at k = 1..D (inkfw/conf/eval_acceptance.yaml)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import check_group_choices, run_user_command
from inkfw.paths import config_dir


@hydra.main(config_path=str(config_dir()), config_name="eval_acceptance", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from inkfw.eval_acceptance import run_eval_acceptance

    run_user_command(run_eval_acceptance, cfg)


if __name__ == "__main__":
    check_group_choices(config_dir())
    main()
