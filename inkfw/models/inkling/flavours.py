"""Named Inkling sizes ("flavours"). A ``inkfw/conf/model/*.yaml`` preset names one (``flavour: debug``)
and may override single fields (``+model.sizes.num_layers=2``).

``release`` and ``small`` are the published checkpoints' layouts; where the public record says
nothing, they keep HF transformers 5.23's ``InklingTextConfig`` defaults (noted per field).
The other flavours are small random-init models for tests, the smoke run, benchmarks and the
shipped tiny checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from inkfw.errors import ConfigError
from inkfw.models.inkling.config import InklingConfig, MtpConfig


@dataclass(frozen=True)
class PublishedSize:
    """Parameter counts as the model card states them (backbone with embedding and unembedding)."""

    total: str
    active: str


# fmt: off
# (one line per group of sizes: the formatter's one field per line would hide the table)
FLAVOURS: dict[str, dict[str, Any]] = {  # InklingConfig fields per flavour
    # every layer kind in a few layers: 0 local+dense, 1 global+MoE (log scaling), 2 local+MoE,
    # 3 global+MoE; 4 MTP depths mixing local (0, 2) and global (1, 3); window 16 < rel_extent 32
    "debug": dict(
        vocab_size=512, unpadded_vocab_size=500, hidden_size=64, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, rel_extent=32,
        swa_num_heads=4, swa_num_kv_heads=1, swa_head_dim=16, sliding_window=16, local_layer_ids=[0, 2],
        d_rel=4, log_scaling_n_floor=8, log_scaling_alpha=0.1,
        dense_mlp_idx=1, intermediate_size=128, moe_intermediate_size=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, route_scale=2.5,
        logits_mup_width_multiplier=4.0, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        mtp=MtpConfig(num_nextn_predict_layers=4, chain_hidden_post_norm=True, local_layer_ids=[0, 2]),
    ),
    # benchmark model, "deeper than wide" like the tiny checkpoint: 12 layers of hidden 256 (5 and
    # 11 global), 0-1 dense then a small MoE, vocab 8192, 8 MTP depths (local at even depths). One
    # MTP depth is one dense block: about 1/12 of a target step plus a logits row
    "bench": dict(
        vocab_size=8192, unpadded_vocab_size=8000, hidden_size=256, num_layers=12,
        num_heads=4, num_kv_heads=2, head_dim=64, rel_extent=256,
        swa_num_heads=4, swa_num_kv_heads=2, swa_head_dim=64, sliding_window=128, local_layer_ids=None,
        d_rel=8, log_scaling_n_floor=64, log_scaling_alpha=0.1,
        dense_mlp_idx=2, intermediate_size=768, moe_intermediate_size=256,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, route_scale=2.5,
        logits_mup_width_multiplier=4.0, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        mtp=MtpConfig(num_nextn_predict_layers=8, chain_hidden_post_norm=True, local_layer_ids=[0, 2, 4, 6]),
    ),
    # the architecture of the shipped checkpoints/inkling-tiny (trained from scratch by
    # inkfw/conf/experiment/inkling-tiny-pretrain.yaml): local except 5 and 11 (global, log scaling);
    # 0-1 dense, 2-11 MoE (4 routed + 1 sink); 8 MTP depths, local at even depths
    "tiny": dict(
        vocab_size=4096, unpadded_vocab_size=4096, hidden_size=128, num_layers=12,
        num_heads=4, num_kv_heads=2, head_dim=32, rel_extent=256,
        swa_num_heads=4, swa_num_kv_heads=1, swa_head_dim=32, sliding_window=64,
        local_layer_ids=[0, 1, 2, 3, 4, 6, 7, 8, 9, 10],
        d_rel=8, log_scaling_n_floor=64, log_scaling_alpha=0.1,
        dense_mlp_idx=2, intermediate_size=384, moe_intermediate_size=128,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, route_scale=1.0,
        logits_mup_width_multiplier=1.0, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
        mtp=MtpConfig(num_nextn_predict_layers=8, chain_hidden_post_norm=True, local_layer_ids=[0, 2, 4, 6]),
    ),
    # Inkling-Small (Apache-2.0, 276B total / 12B active): 42 layers, hidden 4096, 32 query heads,
    # 8 KV heads, head dim 128 (in the global and the sliding-window layers: the published count
    # needs both), 256 routed experts top-6 + 2 shared, expert width 2048, every layer MoE, 8 MTP
    # depths shipped in mtp.safetensors (about 4.5 GB)
    "small": dict(
        vocab_size=201024,  # HF default
        unpadded_vocab_size=None,  # HF default (no padded head)
        hidden_size=4096, num_layers=42, num_heads=32, num_kv_heads=8, head_dim=128,
        rel_extent=1024,  # HF default
        swa_num_heads=32, swa_num_kv_heads=8, swa_head_dim=128,
        sliding_window=512,  # HF default
        local_layer_ids=None,  # HF default: every layer i with i % 6 != 5
        d_rel=16, log_scaling_n_floor=None, log_scaling_alpha=0.1,  # HF defaults
        dense_mlp_idx=0, moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=6,
        n_shared_experts=2,
        # not published; the MTP blocks' dense width. 16384 (4 x hidden, as the release model's
        # 24576 = 4 x 6144) makes the 8 depths 4.46 GB in bfloat16, the published ~4.5 GB file;
        # HF's default 24576 would make it 6.07 GB
        intermediate_size=16384,
        route_scale=8.0, logits_mup_width_multiplier=24.0,  # HF defaults
        max_position_embeddings=131072,  # HF default
        # 8 depths (published); chain norm and sliding-window depths: HF defaults (off, none)
        mtp=MtpConfig(num_nextn_predict_layers=8, chain_hidden_post_norm=False, local_layer_ids=[]),
    ),
    # Inkling (975B total / 41B active): HF transformers 5.23's default config, every layer MoE
    # (dense_mlp_idx 0), and the release checkpoint's padded head (200058 real rows) and MTP block
    "release": dict(
        vocab_size=201024, unpadded_vocab_size=200058, hidden_size=6144, num_layers=66,
        num_heads=64, num_kv_heads=8, head_dim=128, rel_extent=1024,
        swa_num_heads=64, swa_num_kv_heads=16, swa_head_dim=128, sliding_window=512,
        local_layer_ids=None,  # every layer i with i % 6 != 5
        d_rel=16, log_scaling_n_floor=None, log_scaling_alpha=0.1,
        dense_mlp_idx=0, intermediate_size=24576, moe_intermediate_size=3072,
        n_routed_experts=256, num_experts_per_tok=6, n_shared_experts=2, route_scale=8.0,
        logits_mup_width_multiplier=24.0, max_position_embeddings=131072,
        mtp=MtpConfig(num_nextn_predict_layers=8, chain_hidden_post_norm=False, local_layer_ids=[0, 2, 4]),
    ),
}
# fmt: on

PUBLISHED: dict[str, PublishedSize] = {
    "release": PublishedSize(total="975B", active="41B"),
    "small": PublishedSize(total="276B", active="12B"),
}


def flavour_config(name: str, overrides: dict[str, Any] | None = None) -> InklingConfig:
    """Flavour ``name`` as an :class:`InklingConfig`, with ``overrides`` (InklingConfig fields;
    ``mtp`` a dict of MtpConfig fields) applied."""
    if name not in FLAVOURS:
        raise ConfigError(f"unknown Inkling flavour {name!r}; choose one of {', '.join(FLAVOURS)}.")
    fields = dict(FLAVOURS[name])
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(InklingConfig)})
    if unknown:
        raise ConfigError(f"flavour {name!r}: {unknown[0]} is not an Inkling config field.")
    mtp = overrides.pop("mtp", None)
    fields.update(overrides)
    try:
        fields["mtp"] = MtpConfig(**{**dataclasses.asdict(fields["mtp"]), **dict(mtp or {})})  # a fresh copy
        return InklingConfig(**fields)
    except TypeError as exc:
        raise ConfigError(f"flavour {name!r}: bad override ({exc}).") from exc
