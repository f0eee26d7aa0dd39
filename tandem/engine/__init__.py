"""The training engine: a ``TrainEngine`` protocol and its PyTorch implementation."""

from tandem.engine.base import LossFn, StepResult, TokenOutputs, TrainEngine
from tandem.engine.config import EngineConfig, LoraConfig
from tandem.engine.micro_batch import balanced_dp_order, karmarkar_karp, token_budget_micro_batches
from tandem.engine.packing import PackedSequences, pack_sequences, positions_from_mask, unpack
from tandem.engine.torch_engine import TorchTrainEngine

__all__ = [
    "EngineConfig",
    "LoraConfig",
    "LossFn",
    "PackedSequences",
    "StepResult",
    "TokenOutputs",
    "TorchTrainEngine",
    "TrainEngine",
    "balanced_dp_order",
    "karmarkar_karp",
    "pack_sequences",
    "positions_from_mask",
    "token_budget_micro_batches",
    "unpack",
]
