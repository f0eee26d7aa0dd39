"""Rollout engines: the native continuous-batching engine and the ``hf`` reference engine."""

from tandem.protocol.generation import Completion, RolloutRequest, SamplingParams
from tandem.rollout.base import RolloutEngine
from tandem.rollout.hf_engine import HFRolloutEngine
from tandem.rollout.native import NativeRolloutEngine
from tandem.rollout.native_config import NativeEngineConfig

__all__ = [
    "Completion",
    "HFRolloutEngine",
    "NativeEngineConfig",
    "NativeRolloutEngine",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingParams",
]
