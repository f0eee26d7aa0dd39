"""The synchronous RL trainer: config, data, rewards, the colocated worker, the loop, metrics and reports.

The names below load on first use, so that importing one of the package's modules (say
``tandem.rl.sequences`` from the pipeline) does not import the trainer, which imports the
pipeline in turn.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.rl.config import (
        ActorConfig,
        AlgorithmConfig,
        FilterGroupsConfig,
        OverlongPenaltyConfig,
        RewardConfig,
        RLDataConfig,
        RolloutConfig,
        TrainConfig,
        TrainerConfig,
    )
    from tandem.rl.config_loader import load_train_config, presets
    from tandem.rl.trainer import RLResult, RLTrainer

_HOMES = {
    **dict.fromkeys(
        [
            "ActorConfig",
            "AlgorithmConfig",
            "FilterGroupsConfig",
            "OverlongPenaltyConfig",
            "RLDataConfig",
            "RewardConfig",
            "RolloutConfig",
            "TrainConfig",
            "TrainerConfig",
        ],
        "tandem.rl.config",
    ),
    "load_train_config": "tandem.rl.config_loader",
    "presets": "tandem.rl.config_loader",
    "RLResult": "tandem.rl.trainer",
    "RLTrainer": "tandem.rl.trainer",
}

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "OverlongPenaltyConfig",
    "RLDataConfig",
    "RLResult",
    "RLTrainer",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "TrainerConfig",
    "load_train_config",
    "presets",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'tandem.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
