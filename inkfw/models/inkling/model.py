"""The Inkling causal LM: backbone, shared unembedding and the MTP depth stack.

Architecture only. One forward serves both worlds: training calls it on whole sequences with
``cache=None``; serving calls the same modules with per-layer caches and explicit positions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from inkfw.cache.interface import LayerCache
from inkfw.errors import ConfigError
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.layers import AttentionTerms, Block, RMSNorm, Router, ShortConv, init_weights
from inkfw.models.inkling.mtp import MtpStack

EmbedSource = Literal["backbone_norm", "raw"]


def default_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1 for every row: [B, T]."""
    B, T = input_ids.shape
    return torch.arange(T, device=input_ids.device).expand(B, T)


class InklingBackbone(nn.Module):
    def __init__(self, cfg: InklingConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.use_embed_norm else None
        self.layers = nn.ModuleList(
            [Block(cfg, local=cfg.is_local(i), moe=cfg.is_moe(i)) for i in range(cfg.num_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed_tokens(self, input_ids: torch.Tensor, normed: bool = True) -> torch.Tensor:
        e = self.embed(input_ids)
        return self.embed_norm(e) if normed and self.embed_norm is not None else e

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: Sequence[LayerCache] | None = None
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)  # [B, T, H]
        terms = AttentionTerms(positions)  # position-only attention terms, shared by every layer
        for i, layer in enumerate(self.layers):
            h = layer(h, positions, caches[i] if caches is not None else None, terms)
        return self.norm(h)


class InklingLM(nn.Module):
    """Backbone + untied unembedding + the first ``mtp_depths`` MTP depths.

    ``embed_source`` picks what MTP depths embed: ``backbone_norm`` (the release and vLLM:
    the backbone's embed_norm applied to the looked-up row) or ``raw`` (HF transformers 5.23).
    """

    def __init__(self, cfg: InklingConfig, mtp_depths: int = 0, embed_source: EmbedSource = "backbone_norm"):
        super().__init__()
        if embed_source not in ("backbone_norm", "raw"):
            raise ConfigError(f"mtp.embed_source must be 'backbone_norm' or 'raw', got {embed_source!r}.")
        self.cfg = cfg
        self.embed_source = embed_source
        self.backbone = InklingBackbone(cfg)
        self.unembed = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = MtpStack(cfg, mtp_depths) if mtp_depths > 0 else None

    @property
    def num_mtp_depths(self) -> int:
        return len(self.mtp) if self.mtp is not None else 0

    def init_weights(self, std: float = 0.02) -> None:
        init_weights(self, std)

    def to_dtype(self, dtype: torch.dtype) -> InklingLM:
        """Cast to ``dtype``, keeping the short convs and the router's bias and scale in fp32."""
        self.to(dtype)
        for m in self.modules():
            if isinstance(m, ShortConv):
                m.float()
            elif isinstance(m, Router):
                m.score_bias = m.score_bias.float()  # a buffer: reassigning keeps it registered
                m.global_scale.data = m.global_scale.data.float()
        return self

    # ---------------------------------------------------------------- target
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, caches: Sequence[LayerCache] | None = None
    ) -> torch.Tensor:
        """input_ids [B, T] -> final-normed hidden states [B, T, H]."""
        if positions is None:
            positions = default_positions(input_ids)
        return self.backbone(input_ids, positions, caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden [..., H] -> logits [..., V] (muP division, unpadded-vocab slice)."""
        out = self.unembed(hidden / self.cfg.logits_mup_width_multiplier)
        return out[..., : self.cfg.logits_vocab_size]

    # ------------------------------------------------------------------- MTP
    def mtp_embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.embed_tokens(token_ids, normed=self.embed_source == "backbone_norm")

    def mtp_step(
        self,
        depth: int,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCache | None = None,
        depth_input: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One depth over a span: g_d [B, T, H] and tokens x[t+d+1] [B, T] -> g_{d+1} [B, T, H].

        ``depth_input``: a fused kernel for the depth's input (``mtp_depth_input`` of
        :class:`~inkfw.kernels.Kernels`: embedding gather, norms and concatenation in one launch);
        None: the modules."""
        assert self.mtp is not None, "model was built without MTP depths"
        if depth_input is None:
            return self.mtp(depth, hidden, self.mtp_embed(token_ids), positions, cache)
        d, backbone_norm = self.mtp.depth(depth), self.backbone.embed_norm
        z = depth_input(
            token_ids,
            self.backbone.embed.weight,
            backbone_norm.weight if backbone_norm is not None and self.embed_source == "backbone_norm" else None,
            hidden,
            d.hidden_norm.weight,
            d.embed_norm.weight,
            eps=d.hidden_norm.eps,
        )  # [B, T, 2H]
        return self.mtp.from_input(depth, z, positions, cache)

    def mtp_chain(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        num_depths: int | None = None,
        positions: torch.Tensor | None = None,
        frozen_depths: int = 0,
    ) -> list[torch.Tensor]:
        """Teacher-forced chain over whole sequences (training, reference drafts).

        hidden [B, T, H] = target hidden states of input_ids [B, T]. Returns g_1..g_D, each
        [B, T, H]; g_{d+1}[t] predicts x[t+d+2] and is meaningful for t <= T-d-3 (later
        positions read padding tokens beyond the sequence and must be masked by the caller).
        The first ``frozen_depths`` depths run without autograd (training later depths only).
        """
        depths = self.num_mtp_depths if num_depths is None else num_depths
        if positions is None:
            positions = default_positions(input_ids)
        outs, g = [], hidden
        for d in range(depths):
            # tokens x[t+d+1], padded with 0 past the end
            shifted = torch.zeros_like(input_ids)  # [B, T]
            shifted[:, : max(0, input_ids.shape[1] - d - 1)] = input_ids[:, d + 1 :]
            with torch.set_grad_enabled(torch.is_grad_enabled() and d >= frozen_depths):
                g = self.mtp_step(d, g, shifted, positions)
            outs.append(g)
        return outs
