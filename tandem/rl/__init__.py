"""The RL trainer: config, data, rewards, the actor/critic/reward workers, the loop, metrics and reports."""

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
