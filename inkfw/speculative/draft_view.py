"""What speculative decoding needs from a checkpoint's MTP block: depths built =
min(n_predict, requested), and the number of prefill steps P = min(depths, draft tokens)."""

from __future__ import annotations

from dataclasses import dataclass

from inkfw.errors import ConfigError
from inkfw.models.inkling.config import InklingConfig


@dataclass(frozen=True)
class DraftView:
    """What speculative decoding needs from the MTP block of a checkpoint.

    ``depths`` = min(checkpoint depths, requested), ``prefill_steps`` P = min(depths, k).
    """

    n_predict: int
    depths: int
    num_draft_tokens: int
    chain_hidden_post_norm: bool
    local_layer_ids: tuple[int, ...]

    @property
    def prefill_steps(self) -> int:
        return min(self.depths, self.num_draft_tokens)

    @classmethod
    def from_config(
        cls, cfg: InklingConfig, requested_depths: int | None = None, num_draft_tokens: int | None = None
    ) -> DraftView:
        n_predict = cfg.mtp.num_nextn_predict_layers
        depths = n_predict if requested_depths is None else min(n_predict, int(requested_depths))
        if depths < 1:
            if n_predict < 1:
                raise ConfigError(
                    "the checkpoint ships no MTP depths (mtp_config.num_nextn_predict_layers is 0); "
                    "train some with scripts/train.py task=mtp."
                )
            raise ConfigError(f"mtp.depths must be >= 1, got {requested_depths}.")
        k = depths if num_draft_tokens is None else int(num_draft_tokens)
        if k < 1:
            raise ConfigError(f"spec.num_tokens (draft tokens per step) must be >= 1, got {num_draft_tokens}.")
        return cls(
            n_predict=n_predict,
            depths=depths,
            num_draft_tokens=k,
            chain_hidden_post_norm=cfg.mtp.chain_hidden_post_norm,
            local_layer_ids=tuple(cfg.mtp.local_layer_ids),
        )
