"""Reward models (``tandem rm``): a Bradley–Terry reward head trained on preference pairs."""

from tandem.rm.config import RewardModelConfig, RewardModelTrainerConfig
from tandem.rm.trainer import RewardModelTrainer

__all__ = ["RewardModelConfig", "RewardModelTrainer", "RewardModelTrainerConfig"]
