"""``scripts/train.py`` and ``scripts/export.py``: everything from config, then fit; export.

Every training config group is a ``_target_`` node, instantiated here: ``task`` builds the
model and decides what trains (:mod:`inkfw.train.tasks`), ``data`` is the datamodule,
``optim`` / ``scheduler`` are ``_partial_`` nodes the module calls, ``callbacks`` is a dict of
callback nodes, ``trainer`` is :class:`lightning.pytorch.Trainer`, ``logger`` a Lightning
logger. The resolved config is saved in every Lightning checkpoint, so an export needs only
the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from inkfw.errors import CheckpointError, ConfigError
from inkfw.models.inkling.checkpoint import export_checkpoint
from inkfw.models.inkling.model import InklingLM
from inkfw.nodes import build_node, check_setting_types
from inkfw.options import bool_option, int_option
from inkfw.presets import parse_dtype, resolve_path
from inkfw.train.module import InklingTrainModule
from inkfw.train.tasks import TrainTask

TRAIN_CONFIG_KEY = "hyper_parameters"  # where Lightning keeps save_hyperparameters() in a .ckpt


def build_task_model(cfg: Any) -> tuple[TrainTask, InklingLM, Path | None]:
    """(task, the model it trains, the checkpoint's tokenizer.json or None) from a training config."""
    task: TrainTask = build_node("task", cfg.task)
    model, ckpt_tokenizer = task.build_model(cfg.model, cfg.mtp.depths, cfg.mtp.embed_source)
    return task, model, ckpt_tokenizer


def run_train(cfg: Any) -> dict[str, Any]:
    eval_cfg = cfg.get("eval") or {}
    eval_num_prompts = int_option(eval_cfg.get("num_prompts", 0), "eval.num_prompts", 0)
    eval_prompt_tokens = int_option(eval_cfg.get("prompt_tokens", 64), "eval.prompt_tokens")
    eval_max_new_tokens = int_option(eval_cfg.get("max_new_tokens", 32), "eval.max_new_tokens")
    activation_checkpointing = bool_option(cfg.get("activation_checkpointing", False), "activation_checkpointing")
    export = bool_option(cfg.export, "export")
    L.seed_everything(int_option(cfg.seed, "seed", 0), workers=True, verbose=False)
    # a setting given as text where its node's target takes a number fails here, in one line,
    # before anything is built (the scheduler reads trainer.max_steps: the trainer's come first)
    nodes = {group: cfg.get(group) for group in ("trainer", "task", "data", "optim", "scheduler", "logger")}
    nodes |= {f"callbacks.{name}": node for name, node in (cfg.get("callbacks") or {}).items()}
    for group, node in nodes.items():
        if node is not None:
            check_setting_types(group, node)
    # the run as asked, before anything is built; saved in every checkpoint
    train_config = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=True))
    task, model, ckpt_tokenizer = build_task_model(cfg)
    tokenizer = cfg.data.tokenizer or ckpt_tokenizer
    if tokenizer is None:
        raise ConfigError(
            "data.tokenizer is not set and the checkpoint has no tokenizer.json; "
            "train one with scripts/train_tokenizer.py."
        )
    data = build_node(
        "data",
        cfg.data,
        tokenizer=resolve_path(tokenizer),
        eos_id=model.cfg.eos_token_ids[0],
        vocab_size=model.cfg.vocab_size,
    )
    data.setup("fit")  # bad data fails here, in one line, before the trainer starts
    # the first rows only (data=hidden reads rows from disk; its rows also carry hidden states)
    eval_prompts = [
        data.val_set[i][0][:eval_prompt_tokens].tolist() for i in range(min(eval_num_prompts, len(data.val_set)))
    ]
    module = InklingTrainModule(
        model,
        task,
        optimizer=build_node("optim", cfg.optim),
        scheduler=build_node("scheduler", cfg.scheduler) if cfg.get("scheduler") else None,
        eval_prompts=eval_prompts,
        eval_max_new_tokens=eval_max_new_tokens,
        train_config=train_config,
        activation_checkpointing=activation_checkpointing,
    )
    module.configure_optimizers()  # optimizer and scheduler settings out of range fail here, in one line
    logger = build_node("logger", cfg.logger) if cfg.get("logger") else False
    callbacks = [
        build_node(f"callbacks.{name}", node) for name, node in (cfg.get("callbacks") or {}).items() if node is not None
    ]
    trainer: L.Trainer = build_node("trainer", cfg.trainer, logger=logger, callbacks=callbacks)
    trainer.fit(module, datamodule=data, ckpt_path=cfg.ckpt_path)
    result: dict[str, Any] = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v)}
    if trainer.is_global_zero and export:
        path = export_checkpoint(
            model.eval(),
            Path(cfg.output_dir).expanduser() / "export",
            tokenizer_json=resolve_path(tokenizer),
            dtype=parse_dtype(cfg.export_dtype),
        )
        result["export"] = str(path)
        print(f"exported {model.num_mtp_depths} MTP depth(s) to {path}")
    return result


def read_training_checkpoint(ckpt_file: Path) -> tuple[DictConfig, dict[str, torch.Tensor]]:
    """(the training config saved in a Lightning checkpoint, the model's state dict)."""
    if not ckpt_file.is_file():
        raise ConfigError(f"checkpoint {ckpt_file} does not exist.")
    try:
        ckpt = torch.load(ckpt_file, map_location="cpu", weights_only=False)
        state = ckpt["state_dict"]
    except Exception as exc:  # torch raises many kinds on a bad file
        raise CheckpointError(f"{ckpt_file} is not a readable Lightning checkpoint ({type(exc).__name__}).") from exc
    train_config = ckpt.get(TRAIN_CONFIG_KEY)
    if not isinstance(train_config, dict) or "task" not in train_config:
        raise CheckpointError(
            f"{ckpt_file} holds no training config (it was written before checkpoints "
            f"recorded one); train again, or export it with the inkfw release that wrote it."
        )
    model_state = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    return OmegaConf.create(dict(train_config)), model_state


def run_export(cfg: Any) -> Path:
    """Export a Lightning checkpoint of a training run (``ckpt_path``) in the release layout.

    The run's config comes from the checkpoint; the options are ``out`` (null:
    ``<output_dir>/export`` of the run), ``export_dtype`` (null: the run's) and ``mtp_file``
    (the MTP depths in a side file ``mtp.safetensors``).
    """
    if not cfg.ckpt_path:
        raise ConfigError("export needs ckpt_path=PATH (a Lightning .ckpt written by scripts/train.py).")
    mtp_file = bool_option(cfg.get("mtp_file", False), "mtp_file")
    ckpt_file = Path(cfg.ckpt_path).expanduser()
    train_cfg, model_state = read_training_checkpoint(ckpt_file)
    _, model, ckpt_tokenizer = build_task_model(train_cfg)
    try:
        model.load_state_dict(model_state)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{ckpt_file}: the weights do not fit the model its config describes ({str(exc).splitlines()[0]})."
        ) from exc
    tokenizer = train_cfg.data.tokenizer or ckpt_tokenizer
    out = Path(cfg.out if cfg.get("out") else Path(train_cfg.output_dir) / "export").expanduser()
    dtype = cfg.export_dtype if cfg.get("export_dtype") else train_cfg.export_dtype
    path = export_checkpoint(
        model.eval(),
        out,
        tokenizer_json=resolve_path(tokenizer) if tokenizer else None,
        dtype=parse_dtype(dtype),
        mtp_file=mtp_file,
    )
    print(f"exported {model.num_mtp_depths} MTP depth(s) from {ckpt_file} to {path}")
    return path
