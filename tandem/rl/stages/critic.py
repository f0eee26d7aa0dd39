"""The critic's values, when the advantage estimator reads them (``gae``): a critic is trained."""

from __future__ import annotations

from typing import Any

from tandem.rl.metrics import timed
from tandem.rl.stages.base import register_step_stage


@register_step_stage("critic", "pass", applies=lambda config: config.uses_critic, order=40)
def critic(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``values``: the critic's value of each response token (its update runs with the actor's)."""
    with timed(timings, "values"):
        data.stage(trainer.critics, trainer.critics.compute_values)
