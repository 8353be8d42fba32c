"""A contiguous, position-indexed cache: one slot per position, per request row.

This is the simplest :class:`~inkfw.cache.interface.LayerCache`: slot p of row b holds what
position p of request b wrote last. Positions never written (or invalidated) are absent: masked
for attention and read as zeros by the short convolutions. It backs tests and the smoke run; the serving engine's
paged pool implements the same protocol over blocks.
"""

from __future__ import annotations

import torch

from inkfw.cache.interface import EMPTY_POSITION, NUM_CONV_STREAMS, conv_channels


class DenseLayerCache:
    """KV and conv inputs of one layer for ``batch`` rows of up to ``max_len`` positions."""

    def __init__(
        self,
        batch: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        conv_channels: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.max_len = max_len
        self.k = torch.zeros(batch, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.conv = [torch.zeros(batch, max_len, c, dtype=dtype, device=device) for c in conv_channels]
        assert len(self.conv) == NUM_CONV_STREAMS
        # which positions hold something; the others are reported as empty / read as zeros
        self.written = torch.zeros(batch, max_len, dtype=torch.bool, device=device)

    def _check(self, positions: torch.Tensor) -> None:
        if torch.compiler.is_compiling():  # this host read would break the compiled graph: eager only
            return
        if positions.numel() and int(positions.max()) >= self.max_len:
            raise ValueError(f"position {int(positions.max())} is beyond the cache length {self.max_len}")

    def update_kv(self, k, v, positions):
        self._check(positions)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # [B, 1]
        self.k[rows, positions] = k.to(self.k.dtype)
        self.v[rows, positions] = v.to(self.v.dtype)
        self.written[rows, positions] = True
        slots = torch.arange(self.max_len, device=k.device)[None, :]  # [1, S]
        key_positions = torch.where(self.written, slots, EMPTY_POSITION)  # [B, S]
        return self.k, self.v, key_positions

    def conv_window(self, stream, x, positions, kernel_size):
        self._check(positions)
        store = self.conv[stream]
        rows = torch.arange(x.shape[0], device=x.device)[:, None]
        store[rows, positions] = x.to(store.dtype)
        self.written[rows, positions] = True
        offsets = torch.arange(-(kernel_size - 1), 1, device=x.device)  # [K]
        window_pos = positions[:, :, None] + offsets  # [B, T, K]
        at = (rows[:, :, None], window_pos.clamp(min=0))
        window = store[at]  # [B, T, K, C]
        return window.masked_fill(~((window_pos >= 0) & self.written[at])[..., None], 0.0)

    def invalidate(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Forget what ``positions`` [N] of ``rows`` [N] hold: masked as keys, zeros as conv inputs."""
        self.written[rows, positions] = False


class DenseModelCache:
    """Dense caches for every target layer and every MTP depth of one model."""

    def __init__(
        self,
        model,
        batch: int,
        max_len: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        param = next(model.parameters())
        dtype = dtype or param.dtype
        device = device or param.device

        def make(block) -> DenseLayerCache:
            return DenseLayerCache(
                batch, max_len, block.attn.num_kv_heads, block.attn.head_dim, conv_channels(block), dtype, device
            )

        self.layers = [make(layer) for layer in model.backbone.layers]
        self.mtp = [make(depth.block) for depth in model.mtp.depths] if model.mtp is not None else []
