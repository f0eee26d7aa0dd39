"""Step metrics with verl's names: data statistics, timings and throughput."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from tandem.protocol import Batch
from tandem.protocol.sequences import prompt_lengths, response_lengths
from tandem.rl.row_fields import SEQUENCE_REWARD, SEQUENCE_SCORE


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the block's wall time in seconds to ``timings[name]`` (and name the block ``step/<name>``
    in profiler traces of this process)."""
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(f"step/{name}"):
            yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - start


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages (when computed) and lengths of a trained batch (``critic/*``,
    ``response_length/*``, ...). A batch whose tokens stayed in the data plane holds each row's
    score and reward (``sequence_score``, ``sequence_reward``) and no ``advantages``: the advantages
    on the ranks measured those (:mod:`tandem.rl.ref_advantages`)."""
    lengths = response_lengths(batch)  # an agent's tool turns included
    prompts = prompt_lengths(batch)
    scores = batch["token_level_scores"].sum(-1) if "token_level_scores" in batch else batch[SEQUENCE_SCORE]
    rewards = (
        batch["token_level_rewards"].sum(-1) if "token_level_rewards" in batch else batch[SEQUENCE_REWARD]
    )
    metrics = {
        **_stats("critic/score", scores),
        **_stats("critic/rewards", rewards),
        **_stats("response_length", lengths),
        "response_length/clip_ratio": float((lengths >= max_response_length).float().mean()),
    }
    if "advantages" in batch:  # online DPO trains on pairs, not advantages
        metrics.update(_stats("critic/advantages", batch["advantages"][batch["response_mask"].bool()]))
    metrics.update(_stats("prompt_length", prompts))
    return metrics


def value_metrics(batch: Batch) -> dict[str, float]:
    """The critic's values against the returns of a step's batch (verl's ``critic/values/*``,
    ``critic/returns/*``, ``critic/vf_explained_var``): how much of the returns' variance the
    values the advantages used explain (1: all, 0: no better than a constant)."""
    mask = batch["response_mask"].bool()
    values, returns = batch["values"][mask].float(), batch["returns"][mask].float()
    if not values.numel():  # every token rejected (rollout correction): nothing to measure
        return {}
    variance = returns.var(unbiased=False)
    explained = 1.0 - (returns - values).var(unbiased=False) / variance if variance > 0 else torch.tensor(0.0)
    return {
        **_stats("critic/values", values),
        **_stats("critic/returns", returns),
        "critic/vf_explained_var": float(explained),
    }


def timing_metrics(timings: dict[str, float], num_tokens: int, num_workers: int) -> dict[str, float]:
    """``timing_s/<stage>`` and ``perf/throughput`` (tokens per second per worker over the whole step)."""
    metrics = {f"timing_s/{name}": value for name, value in timings.items()}
    step = timings.get("step", 0.0)
    metrics["perf/total_num_tokens"] = float(num_tokens)
    if step > 0:
        metrics["perf/throughput"] = num_tokens / step / num_workers
    return metrics
