"""Parameter counts of an Inkling model built on the meta device (no memory), backbone and MTP apart."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.layers import MoE
from inkfw.models.inkling.model import InklingLM


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int  # per token: routed experts count top_k / n_routed of their weights


def _count(modules: list[torch.nn.Module], cfg: InklingConfig) -> ParamCount:
    total = inactive = 0
    for mod in modules:
        total += sum(p.numel() for p in mod.parameters())
        for m in mod.modules():
            if isinstance(m, MoE):
                routed = m.experts_gate_up.numel() + m.experts_down.numel()
                inactive += routed - routed * cfg.num_experts_per_tok // cfg.n_routed_experts
    return ParamCount(total, total - inactive)


def count_parameters(cfg: InklingConfig, mtp_depths: int | None = None) -> dict[str, ParamCount]:
    """``{"backbone": ..., "mtp": ...}``; the backbone includes embedding and unembedding
    (the MTP depths share them and are counted without them)."""
    depths = cfg.mtp.num_nextn_predict_layers if mtp_depths is None else mtp_depths
    with torch.device("meta"):
        model = InklingLM(cfg, mtp_depths=depths)
    out = {"backbone": _count([model.backbone, model.unembed], cfg)}
    out["mtp"] = _count([model.mtp], cfg) if model.mtp is not None else ParamCount(0, 0)
    return out
