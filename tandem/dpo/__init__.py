"""Preference optimization (``tandem dpo``): pairs and unpaired rows, losses, the trainers."""

from tandem.dpo.config import DPOConfig, DPOTrainerConfig
from tandem.dpo.data import PreferenceDataConfig, PreferenceDataset, PreferencePair
from tandem.dpo.kto_trainer import KTOTrainer
from tandem.dpo.trainer import DPOResult, DPOTrainer
from tandem.dpo.trainers import preference_trainer
from tandem.dpo.unpaired import UnpairedDataset

__all__ = [
    "DPOConfig",
    "DPOResult",
    "DPOTrainer",
    "DPOTrainerConfig",
    "KTOTrainer",
    "PreferenceDataConfig",
    "PreferenceDataset",
    "PreferencePair",
    "UnpairedDataset",
    "preference_trainer",
]
