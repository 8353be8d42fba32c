"""Engine benchmark: overhead (step time / forward time), tokens/s and KV bytes per configuration."""

from pathlib import Path

import hydra
from omegaconf import DictConfig

from inkfw.bench import run_bench
from inkfw.cli import check_group_choices, run_user_command

CONF = Path(__file__).resolve().parent.parent / "conf"


@hydra.main(config_path="../conf", config_name="bench", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_bench, cfg)


if __name__ == "__main__":
    check_group_choices(CONF)
    main()
