"""Train a byte-level BPE tokenizer.json on a corpus (default: the Python standard library)."""

import hydra
from omegaconf import DictConfig

from inkfw.cli import run_user_command
from inkfw.train.tokenizer import train_tokenizer


def _run(cfg: DictConfig) -> None:
    out = train_tokenizer(list(cfg.sources), int(cfg.vocab_size), cfg.out, cfg.max_documents)
    print(f"wrote {out}")


@hydra.main(config_path="../conf", config_name="train_tokenizer", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_user_command(_run, cfg)


if __name__ == "__main__":
    main()
