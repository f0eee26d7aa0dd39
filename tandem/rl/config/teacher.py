"""``teacher.*``: the model on-policy distillation learns from (``algorithm.distill.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.paths import MODEL_PATH, path_field
from tandem.config.validation import check_choice, check_range
from tandem.engine.config import EngineConfig

TEACHER_PLACEMENTS = ("colocated", "separate")


@dataclass(frozen=True)
class TeacherConfig:
    """The teacher (``teacher.*``): a frozen model that scores the student's sampled tokens, one
    rank per actor worker.

    Attributes:
        model_path: the teacher's HF directory; its tokenizer must be the policy's (the same
            token ids), or the run is refused naming both directories.
        placement: ``colocated`` (inside the actor's processes, on their devices) or
            ``separate`` (a worker group of its own: its own processes, and with Ray GPUs of
            its own).
        engine: its engine's settings for log-prob passes (``teacher.engine.strategy``,
            ``max_tokens_per_micro_batch``, ``param_dtype``, ``sp_size``, ...). Its
            ``model_path``, ``device``, ``seed`` and ``logprob_temperature`` follow the run: the
            teacher's log-probs use the rollout's temperature, as the student's do.
        offload: the teacher's parameters wait on the CPU between its log-prob passes (on the
            CPU it changes nothing).
        top_k: also return the teacher's ``k`` most likely tokens and their log-probs at each
            response position (``teacher_top_ids`` / ``teacher_top_log_probs [B, R, k]``), so the
            full-vocabulary distribution never travels. The ``jsd`` objective needs it; with
            ``k >= 1`` the greedy-agreement metric is logged too. 0: the sampled tokens' only. More
            than the vocabulary the teacher and the student share is refused when the run starts
            (:func:`tandem.rl.teacher_worker.shared_vocabulary`).
    """

    model_path: str = path_field(MODEL_PATH)
    placement: str = "colocated"
    engine: EngineConfig = field(default_factory=EngineConfig)
    offload: bool = False
    top_k: int = 0

    def __post_init__(self) -> None:
        check_choice("teacher", "placement", self.placement, TEACHER_PLACEMENTS)
        check_range("teacher", "top_k", self.top_k, low=0)
        if self.engine.lora.rank:
            raise ValueError("teacher.engine.lora.rank: the teacher is frozen; it trains no adapter")
