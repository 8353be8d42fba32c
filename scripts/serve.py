"""OpenAI-compatible HTTP server over the speculative engine (FastAPI + uvicorn)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import check_group_choices, run_user_command
from inkfw.cli_args import prepare_argv
from inkfw.paths import config_dir
from inkfw.server import run_server


@hydra.main(config_path=str(config_dir()), config_name="serve", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(run_server, cfg)


if __name__ == "__main__":
    prepare_argv(config_dir(), "serve", verbatim=False)  # bad overrides: one error line, exit 2
    check_group_choices(config_dir())
    main()
