"""Tiny Inkling configs that cover every layer kind, and weights that make every component matter."""

from __future__ import annotations

import torch

from inkfw.models.inkling.config import InklingConfig, MtpConfig
from inkfw.models.inkling.layers import DenseMLP, MoE, RelativeBias, RMSNorm, Router, ShortConv
from inkfw.models.inkling.model import InklingLM


def tiny_config(**overrides) -> InklingConfig:
    """4 layers: local+dense, local+MoE, global+MoE (log scaling), local+MoE; 3 MTP depths
    mixing local and global; GQA in both layer kinds; window 8 < rel_extent 16."""
    base = dict(
        vocab_size=96,
        unpadded_vocab_size=90,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rel_extent=16,
        swa_num_heads=4,
        swa_num_kv_heads=1,
        swa_head_dim=8,
        sliding_window=8,
        local_layer_ids=[0, 1, 3],
        d_rel=4,
        log_scaling_n_floor=4,
        log_scaling_alpha=0.3,
        dense_mlp_idx=1,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=2,
        route_scale=2.5,
        mtp=MtpConfig(num_nextn_predict_layers=3, chain_hidden_post_norm=True, local_layer_ids=[0, 2]),
    )
    base.update(overrides)
    return InklingConfig(**base)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that every component visibly moves the logits."""
    g = torch.Generator().manual_seed(seed)

    def rnd(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_(torch.randn(p.shape, generator=g) * std + mean)

    for m in model.modules():
        if isinstance(m, RMSNorm):
            rnd(m.weight, 0.2, 1.0)
        elif isinstance(m, torch.nn.Linear):
            rnd(m.weight, 1.0 / m.weight.shape[1] ** 0.5)
        elif isinstance(m, torch.nn.Embedding):
            rnd(m.weight, 1.0)
        elif isinstance(m, ShortConv):
            rnd(m.weight, 0.4)
        elif isinstance(m, RelativeBias):
            rnd(m.table, 0.5)
        elif isinstance(m, DenseMLP):
            rnd(m.gate_up, m.gate_up.shape[1] ** -0.5)
            rnd(m.down, m.down.shape[1] ** -0.5)
            rnd(m.global_scale, 0.2, 1.0)
        elif isinstance(m, MoE):
            for p in (m.experts_gate_up, m.shared_gate_up):
                rnd(p, p.shape[-1] ** -0.5)
            for p in (m.experts_down, m.shared_down):
                rnd(p, p.shape[-1] ** -0.5)
        elif isinstance(m, Router):
            rnd(m.weight, 0.5)
            rnd(m.global_scale, 0.2, 1.0)
            rnd(m.score_bias, 0.1)
    if isinstance(model, InklingLM):
        model.unembed.weight.mul_(model.cfg.logits_mup_width_multiplier * 0.3)
    return model
