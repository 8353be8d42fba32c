"""Write held-out prompts (cut from the validation split only) as JSON lines for scripts/infer.py."""

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.train.data import heldout_prompts


def _run(cfg: DictConfig) -> None:
    rows = heldout_prompts(list(cfg.sources), float(cfg.val_fraction), int(cfg.seed), int(cfg.num_prompts),
                           int(cfg.prompt_chars))
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")


@hydra.main(config_path="../conf", config_name="heldout_prompts", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(_run, cfg)


if __name__ == "__main__":
    main()
