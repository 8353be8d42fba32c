"""Learning-rate schedules (``inkfw/conf/scheduler/``): linear warm-up, then cosine decay or constant.

Each node is ``_partial_``: the training module calls it with the optimizer. The factor of
step ``s`` (0-based, one step per optimizer update) multiplies the optimizer's ``lr``:

* warm-up, ``s < warmup_steps``: ``(s + 1) / warmup_steps``;
* ``warmup_cosine``: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with
  ``p = min(1, (s - warmup_steps) / max(1, max_steps - warmup_steps))``;
* ``warmup_constant``: 1.
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from inkfw.errors import ConfigError
from inkfw.options import int_option


def cosine_factor(step: int, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def constant_factor(step: int, warmup_steps: int) -> float:
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return 1.0


# The factors are partials, not objects with attributes: LambdaLR checkpoints an object's
# attributes and would restore the old run's max_steps on resume; a partial restores nothing,
# so a resumed run follows the schedule of its own config.
def warmup_cosine(
    optimizer: Optimizer, warmup_steps: int = 20, max_steps: int = 1000, min_lr_ratio: float = 0.1
) -> LambdaLR:
    int_option(warmup_steps, "scheduler.warmup_steps", 0)
    if not 0 <= min_lr_ratio <= 1:
        raise ConfigError(f"scheduler.min_lr_ratio must lie in [0, 1], got {min_lr_ratio}.")
    return LambdaLR(
        optimizer,
        partial(cosine_factor, warmup_steps=warmup_steps, max_steps=int(max_steps), min_lr_ratio=float(min_lr_ratio)),
    )


def warmup_constant(optimizer: Optimizer, warmup_steps: int = 20) -> LambdaLR:
    int_option(warmup_steps, "scheduler.warmup_steps", 0)
    return LambdaLR(optimizer, partial(constant_factor, warmup_steps=warmup_steps))
