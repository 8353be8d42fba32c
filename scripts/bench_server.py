"""Load run against the OpenAI-compatible server on loopback: requests/s, TTFT and ITL percentiles."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import check_group_choices, run_user_command
from inkfw.cli_args import prepare_argv
from inkfw.paths import config_dir
from inkfw.server.bench import run_server_bench


@hydra.main(config_path=str(config_dir()), config_name="bench_server", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_server_bench, cfg)


if __name__ == "__main__":
    prepare_argv(config_dir(), "bench_server", verbatim=False)  # bad overrides: one error line, exit 2
    check_group_choices(config_dir())
    main()
