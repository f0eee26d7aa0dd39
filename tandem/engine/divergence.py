"""Divergence: optimizer steps skipped for non-finite values, and the model's health after an update.

The engine skips an optimizer step whose loss or gradient norm is not finite (the weights
stay as they were). A few such steps can be noise; many in a row mean training has
diverged, and :class:`SkippedUpdates` stops the run. A finite update can still wreck the
model (a learning rate of 1e30 leaves every weight near 1e30, finite, but no forward pass
through them is): :class:`ModelHealth` checks the weights and the log-probs of one probe
sequence, and the trainers stop before such weights are synced, saved or exported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tandem.errors import DivergenceError

__all__ = ["DivergenceError", "ModelHealth", "SkippedUpdates", "check_health", "check_skipped_in_a_row"]


@dataclass(frozen=True)
class ModelHealth:
    """One rank's view of the model after an update.

    Attributes:
        finite_weights: every parameter (this rank's shards under FSDP2) is finite.
        max_abs_weight: the largest parameter magnitude on this rank.
        finite_log_probs: the probe sequence's log-probs are finite (True when there was no probe).
    """

    finite_weights: bool
    max_abs_weight: float
    finite_log_probs: bool = True

    @property
    def ok(self) -> bool:
        return self.finite_weights and self.finite_log_probs and math.isfinite(self.max_abs_weight)


def check_health(
    reports: Sequence[ModelHealth],
    step: int,
    last_checkpoint: Callable[[], Path | None],
    model: str = "model",
    outputs: str = "log-probs",
) -> float:
    """The largest weight magnitude over ranks; raises :class:`DivergenceError` naming ``step``
    when any rank's weights or probe outputs are not finite (``model`` and ``outputs`` name them
    in the message: the policy's log-probs, a critic's values). ``last_checkpoint`` (asked only
    then) says where a user can go back to."""
    largest = max(r.max_abs_weight for r in reports)
    if all(r.ok for r in reports):
        return largest
    owner = "the" if model == "model" else f"the {model}'s"
    what = (
        f"{owner} weights are not finite"
        if not all(r.finite_weights for r in reports)
        else f"the {model}'s {outputs} are not finite (largest |weight| {largest:.3g})"
    )
    latest = last_checkpoint()
    where = f"The last checkpoint is {latest}" if latest else "No checkpoint was saved yet"
    raise DivergenceError(
        f"step {step}: after the update {what}: training diverged, and this step's weights are not "
        f"synced, saved or exported. {where}; resume with a lower learning rate"
    )


@dataclass
class SkippedUpdates:
    """Counts optimizer steps skipped for a non-finite loss or gradient norm; ``limit`` in a row stop the run.

    ``field`` is the config key that sets ``limit`` (named in the error).
    """

    limit: int
    field: str
    in_a_row: int = 0
    total: int = 0

    def record(self, skipped: bool) -> None:
        if skipped:
            self.in_a_row += 1
            self.total += 1
        else:
            self.in_a_row = 0

    def check(self, step: int) -> None:
        """Raises :class:`DivergenceError` naming ``step`` once ``limit`` steps in a row were skipped."""
        check_skipped_in_a_row(self.in_a_row, self.limit, self.field, step)


def check_skipped_in_a_row(in_a_row: int, limit: int, field: str, step: int) -> None:
    """Raises :class:`DivergenceError` naming ``step`` when ``in_a_row`` reached ``limit`` (set by ``field``)."""
    if in_a_row >= limit:
        raise DivergenceError(
            f"step {step}: {in_a_row} optimizer steps in a row were skipped because the loss or the "
            f"gradient norm was not finite ({field}={limit}): training diverged. "
            "Lower the learning rate, or check the data and rewards of the recent steps"
        )
