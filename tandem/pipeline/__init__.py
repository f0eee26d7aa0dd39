"""Asynchronous RL pipelines: rollout replicas apart from the trainer, a streaming sample queue.

``pipeline.mode`` picks ``sync`` (the colocated loop of :mod:`tandem.rl.trainer`),
``one_step_off`` or ``fully_async`` (:mod:`.runner`). Finished prompt groups travel as
metadata (:mod:`.sample_queue`) while their tensors wait in shared memory (:mod:`.sample_store`).
"""

from tandem.pipeline.config import MODES, PipelineConfig

__all__ = ["MODES", "PipelineConfig"]
