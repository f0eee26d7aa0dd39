"""The critic's values, when the step's update trains a critic (``StepStage.critic``: the
policy-gradient update's advantage estimator reads values, ``gae``)."""

from __future__ import annotations

from typing import Any

from tandem.rl.metrics import timed
from tandem.rl.stage_registry import uses_critic
from tandem.rl.stages.base import register_step_stage


@register_step_stage("critic", "pass", applies=uses_critic, order=40, streams=True)
def critic(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``values``: the critic's value of each response token (its update runs with the actor's)."""
    with timed(timings, "values"):
        data.stage(trainer.critics, trainer.critics.compute_values)
