"""Typed configuration of an Inkling model and its MTP depths.

One dataclass, :class:`InklingConfig`, describes the text backbone and the MTP depth stack.
It is read from any of the three ``config.json`` dialects users have:

* ``inkling_mm_model``: the release layout, text fields under ``text_config`` and a
  top-level ``mtp_config``;
* ``inkling_model``: the flat release layout, text fields at top level plus ``mtp_config``;
* ``inkling_text``: Hugging Face transformers' own text config (MTP fields inline as
  ``num_mtp_layers`` / ``chain_hidden_post_norm`` / ``mtp_local_layer_ids``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inkfw.checkpoint import read_json_object
from inkfw.errors import ConfigError

MODEL_TYPES = ("inkling_mm_model", "inkling_model", "inkling_text")
TEXT_ONLY_VISION_CONFIG = {
    "model_type": "inkling_vision",
    "hidden_size": 16,
    "n_layers": 2,
    "num_attention_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
}
TEXT_ONLY_AUDIO_CONFIG = {"model_type": "inkling_audio", "n_mel_bins": 4, "mel_vocab_size": 8}


@dataclass
class MtpConfig:
    """The checkpoint's ``mtp_config`` block."""

    num_nextn_predict_layers: int = 0
    chain_hidden_post_norm: bool = False
    local_layer_ids: list[int] = field(default_factory=list)  # MTP depths with sliding-window attention


@dataclass
class InklingConfig:
    """Sizes of the Inkling text backbone (defaults: the release model) and its MTP block."""

    vocab_size: int = 201024
    unpadded_vocab_size: int | None = 200058
    hidden_size: int = 6144
    num_layers: int = 66
    # global ("hybrid") attention layers
    num_heads: int = 64
    num_kv_heads: int = 8
    head_dim: int = 128
    rel_extent: int = 1024
    # sliding-window ("local") attention layers
    swa_num_heads: int = 64
    swa_num_kv_heads: int = 16
    swa_head_dim: int = 128
    sliding_window: int = 512
    local_layer_ids: list[int] | None = None  # None: every i with i % 6 != 5
    d_rel: int = 16
    log_scaling_n_floor: int | None = None
    log_scaling_alpha: float = 0.1
    # MLPs: the first dense_mlp_idx layers are dense, the rest MoE (release and HF 5.23 default: 0, all MoE)
    dense_mlp_idx: int = 0
    intermediate_size: int = 24576  # dense SwiGLU width (also the MTP blocks' MLP)
    moe_intermediate_size: int = 3072
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 2
    route_scale: float = 8.0
    conv_kernel_size: int = 4
    rms_norm_eps: float = 1e-6
    logits_mup_width_multiplier: float = 24.0
    use_embed_norm: bool = True
    max_position_embeddings: int = 131072
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = None
    mtp: MtpConfig = field(default_factory=MtpConfig)

    def __post_init__(self) -> None:
        if isinstance(self.mtp, dict):
            self.mtp = MtpConfig(**self.mtp)
        if self.local_layer_ids is None:
            self.local_layer_ids = [i for i in range(self.num_layers) if i % 6 != 5]
        self.local_layer_ids = sorted(int(i) for i in self.local_layer_ids)
        self.validate()

    # ----------------------------------------------------------------- derived
    @property
    def logits_vocab_size(self) -> int:
        """Number of logits the model returns (the unembedding may be padded beyond it)."""
        if self.unpadded_vocab_size is None:
            return self.vocab_size
        return min(self.vocab_size, self.unpadded_vocab_size)

    def is_local(self, layer_idx: int) -> bool:
        return layer_idx in (self.local_layer_ids or ())

    def is_moe(self, layer_idx: int) -> bool:
        return layer_idx >= self.dense_mlp_idx

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "swa_num_heads",
            "swa_num_kv_heads",
            "swa_head_dim",
            "sliding_window",
            "d_rel",
            "rel_extent",
            "intermediate_size",
            "conv_kernel_size",
        ):
            need(int(getattr(self, name)) >= 1, f"model config: {name} must be >= 1, got {getattr(self, name)}.")
        need(
            self.num_heads % self.num_kv_heads == 0,
            f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}).",
        )
        need(
            self.swa_num_heads % self.swa_num_kv_heads == 0,
            f"model config: swa_num_heads ({self.swa_num_heads}) must be a multiple of swa_num_kv_heads "
            f"({self.swa_num_kv_heads}).",
        )
        need(
            all(0 <= i < self.num_layers for i in self.local_layer_ids or ()),
            f"model config: local_layer_ids {self.local_layer_ids} must lie in [0, {self.num_layers}).",
        )
        need(
            0 <= self.dense_mlp_idx <= self.num_layers,
            f"model config: dense_mlp_idx must lie in [0, {self.num_layers}], got {self.dense_mlp_idx}.",
        )
        if self.dense_mlp_idx < self.num_layers:
            need(
                self.n_routed_experts >= 1 and self.moe_intermediate_size >= 1,
                "model config: MoE layers need n_routed_experts >= 1 and moe_intermediate_size >= 1.",
            )
            need(
                1 <= self.num_experts_per_tok <= self.n_routed_experts,
                f"model config: num_experts_per_tok must lie in [1, n_routed_experts={self.n_routed_experts}], "
                f"got {self.num_experts_per_tok}.",
            )
            need(self.n_shared_experts >= 1, "model config: Inkling MoE layers need n_shared_experts >= 1.")
        need(
            self.mtp.num_nextn_predict_layers >= 0,
            f"model config: mtp_config.num_nextn_predict_layers must be >= 0, got {self.mtp.num_nextn_predict_layers}.",
        )
        need(
            self.unpadded_vocab_size is None or self.unpadded_vocab_size >= 1,
            "model config: unpadded_vocab_size must be >= 1.",
        )

    def mtp_depths_to_build(self, requested: int | None, source: str) -> int:
        """Depths to build: all that ship (``requested`` None) or ``requested``, which may not
        exceed what ``source`` ships."""
        shipped = self.mtp.num_nextn_predict_layers
        depths = shipped if requested is None else int(requested)
        if depths < 0:
            raise ConfigError(f"mtp.depths must be >= 0, got {depths}.")
        if depths > shipped:
            raise ConfigError(
                f"{source}: mtp.depths={depths} but it ships {shipped} MTP depth(s); train more with "
                f"`python scripts/train.py task=mtp mtp.depths={depths} mtp.train_from={shipped}`."
            )
        return depths

    def with_mtp_depths(self, depths: int) -> InklingConfig:
        """A copy whose checkpoint ships ``depths`` MTP depths (for training extra depths)."""
        return dataclasses.replace(self, mtp=dataclasses.replace(self.mtp, num_nextn_predict_layers=depths))

    # ------------------------------------------------------------ (de)serialise
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> InklingConfig:
        """Read any supported ``config.json`` dialect (see module docstring)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}.")
        try:
            return cls._from_dict(raw, source)
        except ConfigError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise ConfigError(f"{source}: malformed model config ({type(exc).__name__}: {exc}).") from exc

    @classmethod
    def _from_dict(cls, raw: dict[str, Any], source: str) -> InklingConfig:
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"{source}: unknown model_type {model_type!r}; inkfw reads {', '.join(MODEL_TYPES)}.")
        if model_type == "inkling_mm_model":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type inkling_mm_model needs a text_config object.")
        else:
            text = raw
        mtp_raw = raw.get("mtp_config") or {}
        if not isinstance(mtp_raw, dict):
            raise ConfigError(f"{source}: mtp_config must be an object.")
        mtp = MtpConfig(
            num_nextn_predict_layers=int(mtp_raw.get("num_nextn_predict_layers", text.get("num_mtp_layers") or 0) or 0),
            chain_hidden_post_norm=bool(
                mtp_raw.get("chain_hidden_post_norm", text.get("chain_hidden_post_norm", False))
            ),
            local_layer_ids=list(mtp_raw.get("local_layer_ids", text.get("mtp_local_layer_ids")) or []),
        )
        return cls._from_text_dict(text, mtp, source)

    @classmethod
    def _from_text_dict(cls, text: dict[str, Any], mtp: MtpConfig, source: str) -> InklingConfig:
        t = dict(text)
        num_layers = int(t.get("num_hidden_layers", t.get("num_layers", 66)))
        # which layers use sliding-window attention
        local_ids = t.get("local_layer_ids")
        for key in ("layer_types", "mlp_layer_types"):
            if t.get(key) is not None and (not isinstance(t[key], list) or len(t[key]) != num_layers):
                raise ConfigError(f"{source}: {key} must be a list of num_hidden_layers={num_layers} entries.")
        if local_ids is None and t.get("layer_types") is not None:
            local_ids = [i for i, kind in enumerate(t["layer_types"]) if kind == "hybrid_sliding"]
        # which layers are dense: a prefix, as dense_mlp_idx or as mlp_layer_types
        dense_mlp_idx = t.get("dense_mlp_idx")
        if dense_mlp_idx is None and t.get("mlp_layer_types") is not None:
            kinds = list(t["mlp_layer_types"])
            dense_mlp_idx = sum(1 for k in kinds if k == "dense")
            if kinds != ["dense"] * dense_mlp_idx + ["sparse"] * (len(kinds) - dense_mlp_idx):
                raise ConfigError(f"{source}: mlp_layer_types must be dense layers followed by sparse ones.")
        # release configs: `intermediate_size` is the experts' width when `dense_intermediate_size` is present
        intermediate = t.get("intermediate_size", 24576)
        moe_intermediate = t.get("moe_intermediate_size", 3072)
        if t.get("dense_intermediate_size") is not None:
            moe_intermediate, intermediate = intermediate, t["dense_intermediate_size"]

        def get(*names: str, default: Any) -> Any:
            for n in names:
                if n in t and t[n] is not None:
                    return t[n]
            return default

        try:
            return cls(
                vocab_size=int(get("vocab_size", default=201024)),
                unpadded_vocab_size=get("unpadded_vocab_size", default=None),
                hidden_size=int(get("hidden_size", default=6144)),
                num_layers=num_layers,
                num_heads=int(get("num_attention_heads", "num_heads", default=64)),
                num_kv_heads=int(get("num_key_value_heads", "num_kv_heads", default=8)),
                head_dim=int(get("head_dim", default=128)),
                rel_extent=int(get("rel_extent", default=1024)),
                swa_num_heads=int(get("swa_num_attention_heads", "swa_num_heads", default=64)),
                swa_num_kv_heads=int(get("swa_num_key_value_heads", "swa_num_kv_heads", default=16)),
                swa_head_dim=int(get("swa_head_dim", default=128)),
                sliding_window=int(get("sliding_window_size", "sliding_window", default=512)),
                local_layer_ids=local_ids,
                d_rel=int(get("d_rel", default=16)),
                log_scaling_n_floor=get("log_scaling_n_floor", default=None),
                log_scaling_alpha=float(get("log_scaling_alpha", default=0.1)),
                dense_mlp_idx=int(dense_mlp_idx or 0),
                intermediate_size=int(intermediate),
                moe_intermediate_size=int(moe_intermediate),
                n_routed_experts=int(get("n_routed_experts", "num_local_experts", default=256)),
                num_experts_per_tok=int(get("num_experts_per_tok", default=6)),
                n_shared_experts=int(get("n_shared_experts", default=2)),
                route_scale=float(get("route_scale", default=8.0)),
                conv_kernel_size=int(get("sconv_kernel_size", "conv_kernel_size", default=4)),
                rms_norm_eps=float(get("rms_norm_eps", default=1e-6)),
                logits_mup_width_multiplier=float(get("logits_mup_width_multiplier", default=24.0)),
                use_embed_norm=bool(get("use_embed_norm", default=True)),
                max_position_embeddings=int(get("max_position_embeddings", "model_max_length", default=131072)),
                bos_token_id=t.get("bos_token_id", 1),
                eos_token_id=t.get("eos_token_id", 2),
                pad_token_id=get("pad_token_id", default=None),
                mtp=mtp,
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: invalid value in config ({exc}).") from exc

    @classmethod
    def from_json(cls, path: str | Path) -> InklingConfig:
        return cls.from_dict(read_json_object(path, error=ConfigError), source=str(path))

    def to_text_dict(self) -> dict[str, Any]:
        """The text fields as Hugging Face's ``inkling_text`` config names them."""
        return {
            "vocab_size": self.vocab_size,
            "unpadded_vocab_size": self.unpadded_vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rel_extent": self.rel_extent,
            "swa_num_attention_heads": self.swa_num_heads,
            "swa_num_key_value_heads": self.swa_num_kv_heads,
            "swa_head_dim": self.swa_head_dim,
            "sliding_window_size": self.sliding_window,
            "local_layer_ids": list(self.local_layer_ids or ()),
            "d_rel": self.d_rel,
            "log_scaling_n_floor": self.log_scaling_n_floor,
            "log_scaling_alpha": self.log_scaling_alpha,
            "mlp_layer_types": ["dense" if i < self.dense_mlp_idx else "sparse" for i in range(self.num_layers)],
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "route_scale": self.route_scale,
            "conv_kernel_size": self.conv_kernel_size,
            "rms_norm_eps": self.rms_norm_eps,
            "logits_mup_width_multiplier": self.logits_mup_width_multiplier,
            "max_position_embeddings": self.max_position_embeddings,
            "use_embed_norm": self.use_embed_norm,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "model_type": "inkling_text",
        }

    def to_release_dict(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``config.json`` in the release layout (``inkling_mm_model``).

        ``extra`` carries top-level keys of a source config (vision/audio configs, token ids)
        through an export unchanged.
        """
        out: dict[str, Any] = {
            k: v for k, v in (extra or {}).items() if k not in ("text_config", "mtp_config", "model_type")
        }
        out["model_type"] = "inkling_mm_model"
        out.setdefault("architectures", ["InklingForConditionalGeneration"])
        # inkfw serves the text backbone only; a checkpoint it creates has no towers. Minimal tower
        # configs keep it loadable by HF transformers (whose defaults would allocate a huge tower).
        out.setdefault("vision_config", dict(TEXT_ONLY_VISION_CONFIG))
        out.setdefault("audio_config", dict(TEXT_ONLY_AUDIO_CONFIG))
        out["text_config"] = self.to_text_dict()
        # the release dialect's names for what every Inkling has; vLLM's Inkling config reads them
        # with other defaults (tests/fixtures/vllm_inkling_loader.json). inkfw reads dense_mlp_idx only.
        out["text_config"].update(
            dense_mlp_idx=self.dense_mlp_idx,
            use_global_scale=True,
            use_gate_bias=True,
            shared_expert_sink=True,
            use_sconv=True,
        )
        out["mtp_config"] = dataclasses.asdict(self.mtp)
        return out
