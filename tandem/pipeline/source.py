"""``BatchSource``: where the RL trainer's batches come from, one interface for every pipeline mode.

The trainer asks a source for each step's generated prompt groups (:meth:`BatchSource.next_batch`),
scores them and runs its stages over them (DAPO's dynamic sampling draws again, ReMax adds greedy
baselines through :meth:`BatchSource.generate`), trains, and hands back each new weight version
(:meth:`BatchSource.after_update`). Once it has built its source it never asks which mode it runs:

* ``sync`` — :class:`tandem.pipeline.colocated.ColocatedRollout`: the trainer's workers generate
  the draw when it is asked for.
* ``one_step_off`` / ``fully_async`` — :class:`tandem.pipeline.runner.AsyncRollout`: rollout
  replicas generate ahead of the trainer, within the staleness bound.

A source whose draws' groups finish one by one may also stream them: ``stream_chunks(groups,
consumer)`` (only :class:`~tandem.pipeline.runner.AsyncRollout` has it, for
``pipeline.stream_forward``) hands ``consumer`` each draw's rows in chunks of ``groups`` prompt
groups, in the draw's order, as they finish (:mod:`tandem.pipeline.draw_chunks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tandem.dataplane import BatchRef
from tandem.protocol import Batch
from tandem.protocol.generation import SamplingParams


@dataclass(frozen=True)
class StepShape:
    """What one draw holds: ``groups`` prompt groups of ``responses`` responses each, sampled with
    ``sampling``; every response's seed derives from ``seed`` (the run's)."""

    groups: int
    responses: int
    sampling: SamplingParams
    seed: int


class BatchSource(Protocol):
    """The trainer's one seam to generation (see the module docstring)."""

    def start(self, trainer_version: int) -> None:
        """Get ready to serve a trainer whose weights are ``trainer_version`` (a resumed run's step)."""

    def next_batch(self, step: int, draw: int) -> tuple[Batch | BatchRef, dict[str, float]]:
        """Step ``step``'s ``draw``-th set of generated, unscored prompt groups (``draw`` counts from
        1; DAPO's dynamic sampling draws again while too few groups carry a signal), as rows of
        ``StepShape.responses`` responses per group, each group's rows consecutive and sharing its
        ``uid``; and the draw's ``pipeline/*`` metrics. A ``BatchRef`` when the rows' per-token
        fields stay where they were generated (:mod:`tandem.pipeline.stored_rollout`)."""
        ...

    def generate(
        self, prompts: Batch, seeds: list[int], sampling: SamplingParams, version: int | None
    ) -> Batch:
        """One response per row of ``prompts`` with its own seed, under weights ``version`` (the
        engines are brought up to it first) or, with ``None``, under whatever weights the engines
        hold now (a baseline that only needs to be independent of the sampled responses)."""
        ...

    def after_update(self, version: int) -> dict[str, float]:
        """The trainer now has weights ``version``; returns the weight sync's metrics."""
        ...

    def host_pids(self) -> list[int]:
        """The processes of this host that the source started (their shared-memory files are the run's)."""
        ...

    def agent_tool_totals(self) -> list[dict[str, tuple[int, int, float]]]:
        """Each engine's agent tool ``(calls, errors, seconds)`` since the last call."""
        ...

    def start_profile(self, directory: str) -> None:
        """Record generation with the PyTorch profiler into ``directory`` (where it runs apart)."""

    def stop_profile(self) -> list[str]:
        """Stop recording; the trace files written."""
        ...

    def close(self, failed: bool = False) -> None:
        """Stop everything the source started (``failed``: without ceremony)."""


SUMMED_DRAW_METRICS = (
    "pipeline/trainer_idle_s",
    "pipeline/rollout_idle_s",
    "pipeline/weight_sync_s",
    "pipeline/dropped_stale",
    "pipeline/partial_samples",
    "pipeline/rollout_wait_s",
    "pipeline/streamed_rows",
    "pipeline/stream_forward_s",
)
MAXIMUM_DRAW_METRICS = ("pipeline/staleness/max", "pipeline/inflight_bytes_max")


def merge_draw_metrics(total: dict[str, float], draw: dict[str, float]) -> dict[str, float]:
    """One step's metrics from those of its draws: waits, syncs and counts add up, the largest
    staleness and the most bytes in flight are kept, and any other metric reads as in the last draw."""
    merged = {**total, **draw}
    for name in SUMMED_DRAW_METRICS:
        if name in total and name in draw:
            merged[name] = total[name] + draw[name]
    for name in MAXIMUM_DRAW_METRICS:
        if name in total and name in draw:
            merged[name] = max(total[name], draw[name])
    return merged
