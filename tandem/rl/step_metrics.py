"""The RL step's metrics put together: the workers' per-rank metrics reduced to one value each,
and what every step logs after its update (memory, data statistics, episodes, timings, epoch)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.agents.loops import batch_episode_metrics
from tandem.protocol import Batch
from tandem.protocol.sequences import sequence_lengths
from tandem.rl.metric_shares import reduce_metric
from tandem.rl.metrics import data_metrics, timing_metrics


def reduced_worker_metrics(per_worker: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric from each worker's own (:func:`tandem.rl.metric_shares.reduce_metric`:
    shares of the mini-batch's values add up, maxima take the max, per-step values average)."""
    return {name: reduce_metric(name, [m[name] for m in per_worker]) for name in per_worker[0]}


def step_end_metrics(
    batch: Batch,
    memory: list[dict[str, float]],
    tool_totals: Callable[[], list[dict[str, tuple[int, int, float]]]],
    timings: dict[str, float],
    max_response_length: int,
    world_size: int,
    epoch: int,
) -> dict[str, float]:
    """What a step logs beside its update's metrics, in this order: the largest rank's ``memory``
    per phase (empty on the CPU), the trained ``batch``'s data statistics and agent episodes
    (``tool_totals``: the rollout's tool calls since the last ask), ``timings`` with the throughput
    over the batch's tokens on ``world_size`` workers, and the sampler's ``epoch``."""
    metrics = {name: max(m[name] for m in memory) for name in memory[0]}
    metrics.update(data_metrics(batch, max_response_length))
    metrics.update(batch_episode_metrics(batch, tool_totals))
    metrics.update(timing_metrics(timings, int(sequence_lengths(batch).sum()), world_size))
    metrics["training/epoch"] = float(epoch)
    return metrics
