"""Asynchronous RL pipelines: rollout replicas apart from the trainer, a streaming sample queue.

``pipeline.mode`` picks ``sync`` (the trainer workers' own engines, :mod:`.colocated`),
``one_step_off`` or ``fully_async`` (:mod:`.runner`); the RL trainer talks to either the same way. Finished prompt groups travel as
metadata (:mod:`.sample_queue`) while their tensors wait in shared memory (:mod:`.sample_store`).
``pipeline.record_schedule`` writes down which groups each step trained on (:mod:`.schedule_record`,
with the replicas' :mod:`.sample_log`), and ``pipeline.replay`` trains on such a record again
(:mod:`.replay`).
"""

from tandem.pipeline.config import MODES, PipelineConfig

__all__ = ["MODES", "PipelineConfig"]
