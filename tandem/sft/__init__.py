"""Supervised fine-tuning on chat conversations (``tandem sft`` / ``python -m tandem.sft``)."""

from tandem.run.sampler import EpochSampler
from tandem.sft.config import SFTConfig, SFTTrainerConfig
from tandem.sft.data import SFTDataConfig, SFTDataset, tokenize_conversation
from tandem.sft.loss import sft_loss
from tandem.sft.trainer import SFTResult, SFTTrainer

__all__ = [
    "EpochSampler",
    "SFTConfig",
    "SFTDataConfig",
    "SFTDataset",
    "SFTResult",
    "SFTTrainer",
    "SFTTrainerConfig",
    "sft_loss",
    "tokenize_conversation",
]
