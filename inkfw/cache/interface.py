"""The seam between the model and whatever owns cache memory.

The model never knows whether it is training or serving. A layer receives either ``None``
(whole sequences, no cache) or a :class:`LayerCache`, plus the absolute position of every
token. Everything a layer remembers between calls is indexed by position:

* attention keys/values, and
* the inputs of its four short convolutions (k_sconv, v_sconv, attn_sconv, mlp_sconv).

Writing position p again replaces what was there, so a rejected speculative position is
undone by overwriting it later, never by recomputing the past. The sequence length (the
positions a caller asks about), not the buffer, defines what is valid: a query at position
p only ever sees keys and conv inputs at positions <= p.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

# conv streams of one Inkling block, in Hugging Face's conv_idx order
K_SCONV, V_SCONV, ATTN_SCONV, MLP_SCONV = 0, 1, 2, 3
NUM_CONV_STREAMS = 4

# key position carried by cache slots that hold nothing: later than any query, so masked
EMPTY_POSITION = 1 << 40


def conv_channels(block) -> tuple[int, int, int, int]:
    """Channels of a block's four conv streams, in stream order (k, v, attn, mlp)."""
    kv = block.attn.num_kv_heads * block.attn.head_dim
    hidden = block.attn_norm.weight.shape[0]
    return kv, kv, hidden, hidden


@runtime_checkable
class LayerCache(Protocol):
    """Per-layer cache state, addressed by token position."""

    def update_kv(
        self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store ``k, v`` [B, T, Hkv, D] at ``positions`` [B, T].

        Returns ``(keys, values, key_positions)``: keys/values [B, S, Hkv, D] that the
        queries may attend to (including the ones just written) and their positions [B, S].
        Slots that hold nothing carry ``EMPTY_POSITION``.
        """
        ...

    def conv_window(self, stream: int, x: torch.Tensor, positions: torch.Tensor, kernel_size: int) -> torch.Tensor:
        """Store conv inputs ``x`` [B, T, C] at ``positions``; return [B, T, K, C], the inputs
        at positions p-K+1 .. p for every p (zeros before position 0)."""
        ...
