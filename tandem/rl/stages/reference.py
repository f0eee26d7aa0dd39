"""The reference model's log-probs, for a KL term (``algorithm.kl.*``) or a preference loss that
compares to the reference (online DPO): when the step's update declares it reads them
(``StepStage.reference``)."""

from __future__ import annotations

from typing import Any

from tandem.rl.metrics import timed
from tandem.rl.stage_registry import needs_reference
from tandem.rl.stages.base import register_step_stage


@register_step_stage("reference", "pass", applies=needs_reference, order=20, streams=True)
def reference(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``ref_log_probs``: the frozen reference's log-probs of the step's tokens (or pairs)."""
    with timed(timings, "ref"):
        data.stage(trainer.workers, trainer.workers.compute_ref_log_prob)
