"""Model smoke run: cached greedy decoding checked against an uncached forward, plus MTP drafts."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from inkfw.cli import check_group_choices, run_user_command
from inkfw.smoke import smoke_run

CONF = Path(__file__).resolve().parent.parent / "conf"


@hydra.main(config_path="../conf", config_name="smoke", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(smoke_run, cfg)


if __name__ == "__main__":
    check_group_choices(CONF)
    main()
