"""Turn a ``conf/model/*.yaml`` node into an :class:`InklingConfig` or a ready model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from inkfw.checkpoint import load_model
from inkfw.models.inkling.config import InklingConfig, MtpConfig
from inkfw.errors import ConfigError
from inkfw.models.inkling.model import EmbedSource, InklingLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def plain(node: Any) -> Any:
    """A Hydra/OmegaConf node as plain Python containers (other values unchanged)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}.")
    return DTYPES[name]


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without it is a config error."""
    name = str(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} but no CUDA device is available; use device=cpu or device=auto.")
    try:
        return torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"device must be auto, cpu or cuda[:N], got {name!r}.") from exc


def resolve_path(path: str | Path) -> Path:
    """Relative checkpoint paths are taken from the project root when not found where we run."""
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists():
        candidate = Path(__file__).resolve().parent.parent / p
        if candidate.exists():
            return candidate
    return p


def model_config(model_node: Any) -> InklingConfig:
    """Sizes from ``sizes`` (random-init presets) or from ``path``/config.json (real checkpoints)."""
    node = plain(model_node)
    if node.get("path"):
        return InklingConfig.from_json(resolve_path(node["path"]) / "config.json")
    sizes = dict(node.get("sizes") or {})
    if not sizes:
        raise ConfigError(f"model preset {node.get('name')!r} has neither a path nor sizes.")
    mtp = MtpConfig(**(sizes.pop("mtp", None) or {}))
    try:
        return InklingConfig(**sizes, mtp=mtp)
    except TypeError as exc:
        raise ConfigError(f"model preset {node.get('name')!r}: {exc}.") from exc


def build_model(model_node: Any, mtp_depths: int | None = None, dtype: str | torch.dtype = "float32",
                device: str | torch.device = "cpu", embed_source: EmbedSource = "backbone_norm") -> InklingLM:
    """A checkpoint's model (``path``) or a seeded random-init preset (``sizes``)."""
    node = plain(model_node)
    dtype = parse_dtype(dtype)
    device = resolve_device(device)
    if node.get("path"):
        model, _ = load_model(resolve_path(node["path"]), mtp_depths=mtp_depths, dtype=dtype, device=device,
                              embed_source=embed_source)
        return model
    cfg = model_config(node)
    depths = cfg.mtp_depths_to_build(mtp_depths, source=f"preset {node.get('name')!r}")
    model = InklingLM(cfg, mtp_depths=depths, embed_source=embed_source)
    # seeded right before init: the backbone is the same whatever number of depths is built
    torch.manual_seed(int(node.get("init_seed", 0)))
    model.init_weights()
    return model.to(device).to_dtype(dtype).eval()
