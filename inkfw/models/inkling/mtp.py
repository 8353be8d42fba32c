"""Multi-token prediction: one MTP depth and the depth stack (docs/design.md §1).

Depth d at position t reads the previous hidden state ``g_d[t]`` (``g_0`` = the target's
final-normed hidden state) and the embedding of token ``x[t+d+1]``; its output predicts
``x[t+d+2]``::

    z      = input_proj(cat[hidden_norm_d(g_d[t]), embed_norm_d(e)])   # hidden first, 2H -> H
    o      = block_d(z)                                                # dense MLP, 4 sconvs
    g_d+1  = chain_norm(o) if chain_hidden_post_norm else o

Embeddings ``e`` and the unembedding are shared with the backbone (see ``model.py``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from inkfw.cache.interface import LayerCache
from inkfw.models.inkling.config import InklingConfig
from inkfw.models.inkling.layers import Block, RMSNorm


class MtpDepth(nn.Module):
    def __init__(self, cfg: InklingConfig, local: bool):
        super().__init__()
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = Block(cfg, local=local, moe=False)

    def forward(
        self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None = None
    ) -> torch.Tensor:
        return self.from_input(torch.cat([self.hidden_norm(hidden), self.embed_norm(embeds)], dim=-1), positions, cache)

    def from_input(self, z: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """The depth after its normed input ``z`` = cat[hidden_norm(g), embed_norm(e)] [B, T, 2H]
        (built by :meth:`forward`, or by the fused depth-input kernel, inkfw/kernels/depth_input.py)."""
        return self.block(self.input_proj(z), positions, cache)  # [B, T, H]


class MtpStack(nn.Module):
    """The first ``num_depths`` MTP depths of a checkpoint, plus the optional shared chain_norm."""

    def __init__(self, cfg: InklingConfig, num_depths: int):
        super().__init__()
        local = set(cfg.mtp.local_layer_ids)
        self.depths = nn.ModuleList([MtpDepth(cfg, d in local) for d in range(num_depths)])
        self.chain_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if cfg.mtp.chain_hidden_post_norm else None

    def __len__(self) -> int:
        return len(self.depths)

    def forward(
        self,
        depth: int,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """Run depth ``depth``: hidden [B, T, H] (g_d), embeds [B, T, H] -> g_{d+1} [B, T, H]."""
        return self._chained(self.depths[depth](hidden, embeds, positions, cache))

    def from_input(
        self, depth: int, z: torch.Tensor, positions: torch.Tensor, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """Run depth ``depth`` from its normed input z [B, T, 2H] (:meth:`MtpDepth.from_input`)."""
        return self._chained(self.depth(depth).from_input(z, positions, cache))

    def depth(self, depth: int) -> MtpDepth:
        return cast(MtpDepth, self.depths[depth])

    def _chained(self, out: torch.Tensor) -> torch.Tensor:
        return self.chain_norm(out) if self.chain_norm is not None else out
