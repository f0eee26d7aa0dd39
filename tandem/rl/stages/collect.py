"""The step's prompt groups as one scored draw: the collect stage when no draw filter applies."""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.rl.stages.base import register_step_stage


@register_step_stage("one_draw", "collect", applies=lambda config: False, default=True, stored=True)
def one_draw(trainer: Any, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """The step's ``train_batch_size`` prompt groups as the batch source's first draw, scored."""
    scored, draw_metrics, reward_metrics = trainer.scored_draw(1, timings)
    return scored, {**draw_metrics, **reward_metrics}
