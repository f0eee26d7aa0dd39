"""Preference optimization (``tandem dpo``): pairs, losses, the trainer."""

from tandem.dpo.config import DPOConfig, DPOTrainerConfig
from tandem.dpo.data import PreferenceDataConfig, PreferenceDataset, PreferencePair
from tandem.dpo.trainer import DPOResult, DPOTrainer

__all__ = [
    "DPOConfig",
    "DPOResult",
    "DPOTrainer",
    "DPOTrainerConfig",
    "PreferenceDataConfig",
    "PreferenceDataset",
    "PreferencePair",
]
