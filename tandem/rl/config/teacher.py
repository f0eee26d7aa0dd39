"""``teacher.*``: the model on-policy distillation learns from (``algorithm.distill.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.config.paths import INPUT_PATH, path_field
from tandem.config.validation import check_choice, check_range
from tandem.engine.config import EngineConfig

if TYPE_CHECKING:
    from tandem.rl.config.train import TrainConfig

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

    model_path: str = path_field(INPUT_PATH)
    placement: str = "colocated"
    engine: EngineConfig = field(default_factory=EngineConfig)
    offload: bool = False
    top_k: int = 0

    def __post_init__(self) -> None:
        check_choice("teacher", "placement", self.placement, TEACHER_PLACEMENTS)
        check_range("teacher", "top_k", self.top_k, low=0)
        if self.engine.lora.rank:
            raise ValueError("teacher.engine.lora.rank: the teacher is frozen; it trains no adapter")


def check_teacher(config: TrainConfig) -> None:
    """A distillation objective has a teacher and a teacher has an objective; online DPO takes
    neither; the teacher's sequence-parallel size divides the workers, and neither the teacher nor
    (with top-k tokens) the student runs tensor-parallel yet. Errors name the keys."""
    distill, teacher = config.algorithm.distill, config.teacher
    if distill.enabled and not teacher.model_path:
        raise ValueError(
            f"algorithm.distill.objective={distill.objective!r} needs a teacher: set teacher.model_path"
        )
    if teacher.model_path and not distill.enabled:
        raise ValueError(
            "teacher.model_path is set but algorithm.distill.objective=none: choose an objective "
            "(reverse_kl) or leave teacher.model_path unset"
        )
    if distill.enabled and config.prefers:
        raise ValueError(
            "algorithm.distill.objective: online DPO (actor.objective=preference) trains on response pairs, "
            "not per-token advantages; distil with actor.objective=policy_gradient"
        )
    if distill.adds_loss and not teacher.top_k:
        raise ValueError(
            f"algorithm.distill.objective={distill.objective!r} compares distributions over the teacher's top-k "
            "tokens: set teacher.top_k (e.g. 16)"
        )
    if distill.lmbda < 1 and config.pipeline.mode != "sync":
        raise ValueError(
            f"algorithm.distill.lmbda={distill.lmbda} with pipeline.mode={config.pipeline.mode}: steps on the "
            "dataset's responses are drawn step by step, which the asynchronous pipelines' rollout ahead of "
            "the trainer does not do yet; use pipeline.mode=sync"
        )
    if distill.lmbda < 1 and config.algorithm.filter_groups.enable:
        raise ValueError(
            f"algorithm.distill.lmbda={distill.lmbda} with algorithm.filter_groups.enable: a step on the "
            "dataset's responses has one response per group, so no group would ever be kept"
        )
    sp = teacher.engine.sp_size
    if distill.enabled and config.world_size % sp:
        raise ValueError(f"teacher.engine.sp_size={sp} must divide the {config.world_size} workers")
    if distill.enabled and teacher.engine.tp_size > 1:
        raise ValueError(
            f"teacher.engine.tp_size={teacher.engine.tp_size}: the teacher's workers do not dispatch over a "
            "tensor-parallel mesh yet; set teacher.engine.tp_size=1"
        )
    if distill.enabled and teacher.top_k and config.actor.engine.tp_size > 1:
        raise ValueError(
            f"teacher.top_k={teacher.top_k} with actor.engine.tp_size={config.actor.engine.tp_size}: the student's "
            "log-probs of the teacher's top-k tokens are not computed under tensor parallelism yet; set "
            "teacher.top_k=0 or actor.engine.tp_size=1"
        )
