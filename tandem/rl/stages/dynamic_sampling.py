"""DAPO's dynamic sampling (``algorithm.filter_groups.enable``): the step draws again until enough
prompt groups carry a signal (their rewards differ) or ``max_num_gen_batches`` draws are spent; it
then tops up with uninformative groups, which add no gradient."""

from __future__ import annotations

from typing import Any

import torch

from tandem.pipeline.source import merge_draw_metrics
from tandem.protocol import Batch
from tandem.protocol.sequences import concat_sequences, trim_padding
from tandem.rl.stages.base import register_step_stage


@register_step_stage(
    "dynamic_sampling", "collect", applies=lambda config: config.algorithm.filter_groups.enable
)
def dynamic_sampling(trainer: Any, timings: dict[str, float]) -> tuple[Batch, dict[str, float]]:
    """``train_batch_size`` prompt groups, the informative ones of the step's draws first; metrics
    ``dynamic_sampling/gen_rounds`` (draws made) and ``dynamic_sampling/informative_groups``."""
    config = trainer.config
    wanted, n = config.data.train_batch_size, config.rollout.n
    dynamic = config.algorithm.filter_groups
    kept: list[Batch] = []
    spare: list[Batch] = []
    metrics: dict[str, float] = {}
    draw = 0
    while True:
        draw += 1
        scored, draw_metrics, reward_metrics = trainer.scored_draw(draw, timings)
        metrics = merge_draw_metrics(metrics, draw_metrics)
        informative = groups_with_spread(scored, n, dynamic.metric)
        kept.append(scored[informative.repeat_interleave(n).nonzero().flatten()])
        spare.append(scored[(~informative).repeat_interleave(n).nonzero().flatten()])
        have = sum(len(b) for b in kept) // n
        if have >= wanted or draw >= dynamic.max_num_gen_batches:
            break
    pad_id = trainer.tokenizer.pad_token_id
    pool = concat_sequences([b for b in kept + spare if len(b)], pad_id)
    batch = trim_padding(pool[: wanted * n], pad_id)
    reward_metrics["dynamic_sampling/gen_rounds"] = float(draw)
    reward_metrics["dynamic_sampling/informative_groups"] = float(have)
    return batch, {**metrics, **reward_metrics}


def groups_with_spread(batch: Batch, n: int, metric: str) -> torch.Tensor:
    """``[G]`` bool: groups of ``n`` consecutive rows whose ``metric`` (``score``, ``raw_score`` or
    ``acc``) is not all equal."""
    values = batch["token_level_scores"].sum(-1) if metric == "score" else batch[metric]
    return values.view(-1, n).std(dim=1) > 0
