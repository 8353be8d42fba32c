"""Load run against the OpenAI-compatible server on loopback: requests/s, TTFT and ITL percentiles."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.cli_args import check_command_line
from inkfw.paths import config_dir
from inkfw.server.bench import run_server_bench


@hydra.main(config_path=str(config_dir()), config_name="bench_server", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_server_bench, cfg)


if __name__ == "__main__":
    check_command_line("bench_server")  # bad overrides: one error line, exit 2
    main()
