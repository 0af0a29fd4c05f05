"""Learning-rate schedules: linear warmup, then cosine, linear, WSD (warmup-stable-decay) or constant.

The multiplier of step ``s`` (0-based, the step about to run) with warmup ``W``,
``N`` steps in all and floor ``m = min_lr_ratio``:

- warmup, ``s < W``: ``(s + 1) / (W + 1)`` (nanoGPT's ``get_lr``, never exactly 0);
- cosine: ``m + (1 - m) * 0.5 * (1 + cos(pi * r))`` with ``r = (s - W) / (N - W)``;
- linear: ``m + (1 - m) * (1 - r)``;
- wsd: 1 until the last ``decay_fraction`` of the run, then linear to ``m``
  (Hu et al. 2024, MiniCPM);
- constant: 1.

The scheduler is a ``torch.optim.lr_scheduler.LambdaLR``, so its state is
plain numbers and round-trips through a checkpoint exactly.
"""

from __future__ import annotations

import functools
import math

import torch
from plyx.specs import ScheduleConfig

__all__ = ["lr_multiplier", "build_scheduler"]


def lr_multiplier(step: int, config: ScheduleConfig, total_steps: int) -> float:
    """The fraction of the peak learning rate used at optimizer step ``step`` (0-based)."""
    warmup, floor = config.warmup_steps, config.min_lr_ratio
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.kind == "constant":
        return 1.0
    if step >= total_steps:
        return floor
    if config.kind == "wsd":
        decay_steps = max(1, int(round(config.decay_fraction * total_steps)))
        decay_start = max(warmup, total_steps - decay_steps)
        if step < decay_start:
            return 1.0
        ratio = (step - decay_start) / max(1, total_steps - decay_start)
        return floor + (1.0 - floor) * (1.0 - ratio)
    ratio = (step - warmup) / max(1, total_steps - warmup)
    if config.kind == "linear":
        return floor + (1.0 - floor) * (1.0 - ratio)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * ratio))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: ScheduleConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` applying ``lr_multiplier`` to each group's initial learning rate."""
    fn = functools.partial(lr_multiplier, config=config, total_steps=total_steps)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: fn(step))
