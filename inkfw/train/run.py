"""``scripts/train.py``: build the model, data, module, logger and trainer from config; fit; export.

``task=mtp`` starts from a checkpoint (``model.path``) and trains depths
``[mtp.train_from, mtp.depths)``; depths beyond those the checkpoint ships start from the
deepest shipped depth of the same attention kind. ``task=pretrain`` trains a random-init
preset (``model.sizes``) from scratch, with its depths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from omegaconf import OmegaConf

from inkfw.checkpoint import export_checkpoint, load_model
from inkfw.errors import ConfigError
from inkfw.models.inkling.model import InklingLM
from inkfw.presets import build_model, model_config, parse_dtype, resolve_path
from inkfw.train.data import TextDataModule
from inkfw.train.module import InklingTrainModule, OptimConfig


def grow_depths(model: InklingLM, depths: int) -> InklingLM:
    """``model`` with ``depths`` MTP depths: existing ones kept, new ones copied from the
    deepest existing depth of the same attention kind (random init if there is none)."""
    have = model.num_mtp_depths
    if depths <= have:
        return model
    grown = InklingLM(model.cfg.with_mtp_depths(depths), mtp_depths=depths, embed_source=model.embed_source)
    grown.init_weights()
    grown.load_state_dict(model.state_dict(), strict=False)
    for d in range(have, depths):
        kind = grown.mtp.depths[d].block.attn.window
        donors = [s for s in range(have) if model.mtp.depths[s].block.attn.window == kind]
        if donors:
            grown.mtp.depths[d].load_state_dict(model.mtp.depths[donors[-1]].state_dict())
    return grown.to(next(model.parameters()).device)


def build_train_model(cfg: Any) -> tuple[InklingLM, int, Path | None]:
    """(model, train_from, tokenizer.json of the checkpoint or None)."""
    task = cfg.task.name
    requested = cfg.mtp.depths
    if task == "mtp":
        if not cfg.model.get("path"):
            raise ConfigError("task=mtp trains depths on a checkpoint: set model=inkling model.path=DIR.")
        shipped = model_config(cfg.model).mtp.num_nextn_predict_layers
        depths = shipped if requested is None else int(requested)
        if depths < 1:
            raise ConfigError(f"mtp.depths must be >= 1, got {depths}.")
        train_from = cfg.mtp.train_from
        train_from = (shipped if depths > shipped else 0) if train_from is None else int(train_from)
        if not 0 <= train_from <= shipped or train_from >= depths:
            raise ConfigError(f"mtp.train_from={train_from} must lie in [0, {min(shipped, depths - 1)}]: the "
                              f"checkpoint ships {shipped} depth(s) and new depths start right after them.")
        model, ckpt = load_model(resolve_path(cfg.model.path), mtp_depths=min(depths, shipped),
                                 embed_source=cfg.mtp.embed_source)
        return grow_depths(model.train(), depths), train_from, ckpt.tokenizer_path
    model = build_model(cfg.model, mtp_depths=requested, embed_source=cfg.mtp.embed_source)
    return model.train(), 0, None


def run_train(cfg: Any) -> dict[str, Any]:
    L.seed_everything(int(cfg.seed), workers=True, verbose=False)
    out = Path(cfg.output_dir).expanduser()
    model, train_from, ckpt_tokenizer = build_train_model(cfg)
    tokenizer = cfg.data.tokenizer or ckpt_tokenizer
    if tokenizer is None:
        raise ConfigError("data.tokenizer is not set and the checkpoint has no tokenizer.json; "
                          "train one with scripts/train_tokenizer.py.")
    data = TextDataModule(list(cfg.data.sources), resolve_path(tokenizer), seq_len=int(cfg.data.seq_len),
                          batch_size=int(cfg.data.batch_size), val_fraction=float(cfg.data.val_fraction),
                          seed=int(cfg.seed), eos_id=model.cfg.eos_token_ids[0], vocab_size=model.cfg.vocab_size,
                          max_documents=cfg.data.max_documents)
    data.setup("fit")  # bad data fails here, in one line, before the trainer starts
    optim = OptimConfig(**OmegaConf.to_container(cfg.optim, resolve=True))
    optim.max_steps = int(cfg.trainer.max_steps)
    eval_cfg = cfg.get("eval") or {}
    eval_prompts = [ids[: int(eval_cfg.get("prompt_tokens", 64))].tolist()
                    for ids, _ in list(data.val_set)[: int(eval_cfg.get("num_prompts", 0))]]
    module = InklingTrainModule(model, task=cfg.task.name, train_from=train_from, beta=float(cfg.loss.beta),
                                weights=cfg.loss.weights, objective=cfg.loss.objective,
                                mtp_weight=float(cfg.loss.mtp_weight), optim=optim, eval_prompts=eval_prompts,
                                eval_max_new_tokens=int(eval_cfg.get("max_new_tokens", 32)))
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [RichProgressBar(), ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=-1,
                                                    filename="step-{step}", auto_insert_metric_name=False,
                                                    every_n_train_steps=int(cfg.checkpoint_every))]
    trainer = L.Trainer(**OmegaConf.to_container(cfg.trainer, resolve=True), logger=logger, callbacks=callbacks,
                        default_root_dir=str(out))
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    result: dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v)}
    if trainer.is_global_zero and cfg.export:
        path = export_checkpoint(model.eval(), out / "export", tokenizer_json=resolve_path(tokenizer),
                                 dtype=parse_dtype(cfg.export_dtype))
        result["export"] = str(path)
        print(f"exported {model.num_mtp_depths} MTP depth(s) to {path}")
    return result


def run_export(cfg: Any) -> Path:
    """Export a Lightning checkpoint of a training run (``ckpt_path``) in the release layout."""
    if not cfg.ckpt_path:
        raise ConfigError("export needs ckpt_path=PATH (a Lightning .ckpt written by scripts/train.py).")
    ckpt_file = Path(cfg.ckpt_path).expanduser()
    if not ckpt_file.is_file():
        raise ConfigError(f"checkpoint {ckpt_file} does not exist.")
    model, _, ckpt_tokenizer = build_train_model(cfg)
    try:
        state = torch.load(ckpt_file, map_location="cpu", weights_only=False)["state_dict"]
    except Exception as exc:  # torch raises many kinds on a bad file
        raise ConfigError(f"{ckpt_file} is not a readable Lightning checkpoint ({type(exc).__name__}).") from exc
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")})
    tokenizer = cfg.data.tokenizer or ckpt_tokenizer
    out = Path(cfg.out).expanduser()
    path = export_checkpoint(model.eval(), out, tokenizer_json=resolve_path(tokenizer) if tokenizer else None,
                             dtype=parse_dtype(cfg.export_dtype))
    print(f"exported {model.num_mtp_depths} MTP depth(s) from {ckpt_file} to {path}")
    return path
