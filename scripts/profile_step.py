"""Where a decode step's time goes: torch.profiler over decode steps of the engine infer builds."""

import hydra
from omegaconf import DictConfig

from inkfw.bench.step_profile import report_step_profile
from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir


@hydra.main(config_path=str(config_dir()), config_name="profile_step", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(report_step_profile, cfg)


if __name__ == "__main__":
    check_command_line("profile_step")  # bad overrides: one error line, exit 2
    main()
