"""On-policy distillation (``algorithm.distill.objective``, with ``teacher.*``): the teacher scores
the step's tokens; its tokenizer is checked against the policy's when the trainer is built."""

from __future__ import annotations

from typing import Any

from tandem.models.loading import load_tokenizer
from tandem.rl.metrics import timed
from tandem.rl.stages.base import register_step_stage
from tandem.rl.teacher_worker import check_same_tokenizer, shared_vocabulary


def check_teacher(trainer: Any) -> None:
    """The teacher tokenises as the policy does, and ``teacher.top_k`` fits the vocabulary (before
    any model loads)."""
    config = trainer.config
    teacher = config.teacher.model_path
    check_same_tokenizer(load_tokenizer(teacher), teacher, trainer.tokenizer, config.model_path)
    shared_vocabulary(config)


@register_step_stage("teacher", "pass", applies=lambda config: config.distills, order=30, check=check_teacher)
def teacher(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``teacher_log_probs`` (and the teacher's top-k ids and log-probs with ``teacher.top_k``) of
    the step's tokens."""
    with timed(timings, "teacher"):
        data.stage(trainer.teachers, trainer.teachers.compute_teacher_log_prob)
