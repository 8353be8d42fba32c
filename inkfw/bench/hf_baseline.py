"""The Hugging Face transformers baseline of ``scripts/bench.py``: ``generate`` and
``generate(use_mtp=True)`` of HF 5.23's ``InklingForConditionalGeneration`` on the same
checkpoint, prompts and device as the engine, one prompt at a time (batch 1), greedy.

Timed as a user runs it: the wall time of the ``generate`` calls, including what each call sets
up (``use_mtp=True`` builds HF's MTP model from the checkpoint in every call). HF's MTP drafts
embed the raw token embedding (``mtp.embed_source=raw``), so its acceptance differs from
inkfw's; its output is still greedy decoding's.

EOS: with ``ignore_eos`` the generation config gets ``eos_token_id=[]`` (an empty list; ``None``
would be replaced by the checkpoint's default), so every prompt generates exactly
``max_new_tokens`` tokens, as the engine does with its EOS ids cleared; otherwise both stop at
the checkpoint's EOS ids and tokens/s counts the tokens each generated.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class HfRun:
    """One timed pass over the prompts: seconds and the generated token ids per prompt."""

    wall_s: float
    outputs: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No load reports, kernel-fallback warnings or progress bars from transformers."""
    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class HfBaseline:
    """HF's model loaded from ``path`` (``dtype`` on ``device``), generating greedily."""

    def __init__(
        self,
        path: str | Path,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: list[int],
        ignore_eos: bool,
        load_kwargs: dict[str, Any] | None = None,
    ):
        from transformers import InklingForConditionalGeneration

        with _quiet_transformers():  # load_kwargs: from_pretrained's, e.g. experts_implementation
            model: Any = InklingForConditionalGeneration.from_pretrained(str(path), dtype=dtype, **(load_kwargs or {}))
        self.model = model.to(device).eval()
        self.device = device
        self.eos_token_ids = [] if ignore_eos else list(eos_token_ids)
        self.pad_token_id = int(model.config.get_text_config().pad_token_id or 0)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, use_mtp: bool) -> HfRun:
        """Greedy ``generate`` of each prompt in turn (batch 1), timed as a whole."""
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_mtp=use_mtp,
        )
        ids = [torch.tensor([p], device=self.device) for p in prompts]  # [1, T] each
        outputs: list[list[int]] = []
        with _quiet_transformers(), torch.inference_mode():
            _synchronize(self.device)
            start = time.perf_counter()
            for prompt in ids:
                out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=config)
                outputs.append(out[0, prompt.shape[1] :].tolist())  # [new]; batch 1: no padding
            _synchronize(self.device)
            wall = time.perf_counter() - start
        return HfRun(wall, outputs)
