"""Inkling checkpoints: open, load into an :class:`InklingLM`, export.

The generic safetensors directory handling is ``inkfw/checkpoint.py``; the tensor names are
``state_dict.py``. This module ties them to Inkling's config and model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from inkfw.checkpoint import MTP_FILE, Checkpoint, open_checkpoint_files, write_checkpoint
from inkfw.errors import CheckpointError, ConfigError
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.model import EmbedSource, InklingLM
from inkfw.models.inkling.state_dict import is_mtp_tensor, load_state, release_tensors, resolve


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Read ``config.json`` and the tensor names of an Inkling checkpoint directory (no tensor
    data); every name is checked against the spellings Inkling checkpoints use."""
    ckpt = open_checkpoint_files(path)
    try:
        ckpt.config = InklingConfig.from_dict(ckpt.raw_config, source=str(ckpt.path / "config.json"))
    except ConfigError as exc:
        raise CheckpointError(str(exc)) from exc
    ckpt.layout = resolve(ckpt.config, ckpt).layout
    return ckpt


def load_model(
    path: str | Path,
    mtp_depths: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    embed_source: EmbedSource = "backbone_norm",
) -> tuple[InklingLM, Checkpoint]:
    """Build an :class:`InklingLM` from a checkpoint directory.

    ``mtp_depths``: how many MTP depths to build and read (None: all that ship); asking for
    more than ship is an error (train extra depths with ``scripts/train.py task=mtp``).
    """
    ckpt = open_checkpoint(path)
    depths = ckpt.config.mtp_depths_to_build(mtp_depths, source=str(ckpt.path))
    with torch.device("meta"):
        model = InklingLM(ckpt.config, mtp_depths=depths, embed_source=embed_source)
    # dtypes are set while still on meta, so memory is allocated once, in the final dtype
    model = model.to_dtype(dtype).to_empty(device=device)
    load_state(model, ckpt)
    ckpt.close()
    return model.eval(), ckpt


def export_checkpoint(
    model: InklingLM,
    out_dir: str | Path,
    tokenizer_json: str | Path | None = None,
    extra_config: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
    mtp_file: bool = False,
) -> Path:
    """Write ``model`` in the release layout with its ``config.json`` (and ``tokenizer.json``).

    ``config.json`` records the MTP depths written. ``max_shard_bytes`` splits tensors over
    several files with an index. ``mtp_file`` writes the MTP depths to ``mtp.safetensors``
    beside the main file(s), the way Inkling-Small ships them (the index lists them too).
    The directory appears whole or not at all (see :func:`inkfw.checkpoint.write_checkpoint`).
    """
    cfg = model.cfg.with_mtp_depths(model.num_mtp_depths)
    return write_checkpoint(
        out_dir,
        release_tensors(model, dtype),
        cfg.to_release_dict(extra_config),
        tokenizer_json=tokenizer_json,
        max_shard_bytes=max_shard_bytes,
        side_file=(lambda name: MTP_FILE if is_mtp_tensor(name) else None) if mtp_file else None,
    )
