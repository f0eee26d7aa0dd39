"""Learning-rate schedules: linear warmup, then constant, linear or cosine decay to ``min_lr_ratio``."""

from __future__ import annotations

import math

import torch

from tandem.engine.config import EngineConfig


def lr_multiplier(step: int, config: EngineConfig) -> float:
    """The factor on ``config.lr`` after ``step`` scheduler steps."""
    if config.warmup_steps and step < config.warmup_steps:
        return (step if config.warmup_from_zero else step + 1) / config.warmup_steps
    if config.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    decay = 1.0 - progress if config.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: EngineConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    if config.lr_schedule != "constant" and config.total_steps <= config.warmup_steps:
        raise ValueError(
            f"engine.total_steps={config.total_steps} must exceed warmup_steps={config.warmup_steps} "
            f"for lr_schedule={config.lr_schedule!r}"
        )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, config))
