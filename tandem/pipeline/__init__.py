"""Asynchronous RL pipelines: rollout replicas apart from the trainer, a streaming sample queue.

``pipeline.mode`` picks ``sync`` (the trainer workers' own engines, :mod:`.colocated`),
``one_step_off`` or ``fully_async`` (:mod:`.runner`); the RL trainer talks to either the same way. Finished prompt groups travel as
metadata (:mod:`.sample_queue`) while their tensors wait in shared memory (:mod:`.sample_store`).
"""

from tandem.pipeline.config import MODES, PipelineConfig

__all__ = ["MODES", "PipelineConfig"]
