"""The checkpoint engine: trainer weights to rollout replicas in other processes or on other hosts.

Backends (``checkpoint_engine.backend``): ``broadcast``, ``shared_memory``, ``files``, and
``naive`` for a rollout engine in the trainer's own process. See :mod:`.sync`.
"""

from tandem.checkpoint_engine.config import BACKENDS, CheckpointEngineConfig
from tandem.checkpoint_engine.sync import SenderAddress, SyncStats, WeightReceiver, WeightSender

__all__ = [
    "BACKENDS",
    "CheckpointEngineConfig",
    "SenderAddress",
    "SyncStats",
    "WeightReceiver",
    "WeightSender",
]
