"""Turn a ``inkfw/conf/model/*.yaml`` node into an :class:`InklingConfig`, a ready model, or a parameter report.

A node names either a checkpoint (``path``: sizes from its ``config.json``) or a random-init
flavour (``flavour``: sizes from ``inkfw/models/inkling/flavours.py``, single fields overridable
through ``sizes``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from inkfw.errors import ConfigError
from inkfw.models.inkling.checkpoint import load_model
from inkfw.models.inkling.config import InklingConfig, MtpConfig
from inkfw.models.inkling.flavours import PUBLISHED, flavour_config
from inkfw.models.inkling.model import EmbedSource, InklingLM
from inkfw.models.inkling.params import ParamCount, count_parameters
from inkfw.paths import checkout_root

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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
    """A relative path is taken from the working directory, else from the source checkout when
    inkfw runs from one (``checkpoints/inkling-tiny`` works from any folder there); an installed
    inkfw has no checkout, and a path found nowhere is returned as given, for the caller's
    one-line "not found" error."""
    p = Path(path).expanduser()
    root = checkout_root()
    if not p.is_absolute() and not p.exists() and root is not None and (root / p).exists():
        return root / p
    return p


def model_config(model_node: Any) -> InklingConfig:
    """Sizes from ``path``/config.json (real checkpoints), or from ``flavour`` with the ``sizes``
    overrides (random-init presets); a node with ``sizes`` but no flavour lists every size."""
    node = plain(model_node)
    if node.get("path"):
        return InklingConfig.from_json(resolve_path(node["path"]) / "config.json")
    sizes = dict(node.get("sizes") or {})
    if node.get("flavour"):
        return flavour_config(node["flavour"], sizes)
    if not sizes:
        raise ConfigError(f"model preset {node.get('name')!r} has neither a path nor a flavour.")
    mtp = MtpConfig(**(sizes.pop("mtp", None) or {}))
    try:
        return InklingConfig(**sizes, mtp=mtp)
    except TypeError as exc:
        raise ConfigError(f"model preset {node.get('name')!r}: {exc}.") from exc


def build_model(
    model_node: Any,
    mtp_depths: int | None = None,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    embed_source: EmbedSource = "backbone_norm",
) -> InklingLM:
    """A checkpoint's model (``path``) or a seeded random-init preset (``sizes``)."""
    node = plain(model_node)
    dtype = parse_dtype(dtype)
    device = resolve_device(device)
    if node.get("path"):
        model, _ = load_model(
            resolve_path(node["path"]), mtp_depths=mtp_depths, dtype=dtype, device=device, embed_source=embed_source
        )
        return model
    cfg = model_config(node)
    depths = cfg.mtp_depths_to_build(mtp_depths, source=f"preset {node.get('name')!r}")
    model = InklingLM(cfg, mtp_depths=depths, embed_source=embed_source)
    # seeded right before init: the backbone is the same whatever number of depths is built
    torch.manual_seed(int(node.get("init_seed", 0)))
    model.init_weights()
    return model.to(device).to_dtype(dtype).eval()


def report_parameters(cfg: Any) -> dict[str, ParamCount]:
    """Entry point of ``scripts/count_params.py``: a rich table of the counts, then the
    flavour's published figures beside the backbone's count (model cards count the backbone)."""
    from rich.console import Console
    from rich.table import Table

    model_cfg = model_config(cfg.model)
    num_depths = model_cfg.mtp.num_nextn_predict_layers if cfg.mtp.depths is None else int(cfg.mtp.depths)
    counts = count_parameters(model_cfg, num_depths)
    table = Table(title=f"parameters of {cfg.model.name}")
    for col in ("part", "total", "active / token"):
        table.add_column(col, justify="right" if col != "part" else "left")
    for part, c in counts.items():
        label = part if part != "mtp" else f"mtp ({num_depths} depths)"
        table.add_row(label, f"{c.total:,} ({c.total / 1e9:.2f}B)", f"{c.active:,} ({c.active / 1e9:.2f}B)")
    Console().print(table)
    published = None if cfg.model.get("path") else PUBLISHED.get(cfg.model.get("flavour"))
    if published is not None:
        b = counts["backbone"]
        print(
            f"backbone: {b.total:,} total / {b.active:,} active counted; "
            f"published: {published.total} total / {published.active} active"
        )
    return counts
