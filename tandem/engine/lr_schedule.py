"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to ``min_lr_ratio``."""

from __future__ import annotations

import math

import torch

from tandem.engine.config import EngineConfig


def lr_multiplier(step: int, config: EngineConfig) -> float:
    """The factor on ``config.lr`` after ``step`` scheduler steps."""
    warmup = config.warmup
    if warmup and step < warmup:
        return (step if config.warmup_from_zero else step + 1) / warmup
    if config.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, config.total_steps - warmup))
    decay = 1.0 - progress if config.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: EngineConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    if config.lr_schedule != "constant" and config.total_steps <= config.warmup:
        raise ValueError(
            f"engine.total_steps={config.total_steps} must exceed warmup_steps={config.warmup} "
            f"for lr_schedule={config.lr_schedule!r}"
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config))
