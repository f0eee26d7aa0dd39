"""DAPO's dynamic sampling (``algorithm.filter_groups.enable``): the step draws again until enough
prompt groups carry a signal (their rewards differ) or ``max_num_gen_batches`` draws are spent; it
then tops up with uninformative groups, which add no gradient.

The filter reads per-row scalars only (the score, ``acc`` or ``raw_score`` of each row), so draws
kept in the data plane (``BatchRef`` s, :mod:`tandem.pipeline.stored_rollout`) stay there: the kept
groups are chosen by rewriting the references' row indices, and the blocks of rows no kept row
shares are released at once (the others with the step)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.dataplane import BatchRef
from tandem.pipeline.source import merge_draw_metrics
from tandem.pipeline.stored_rollout import concat_stored, rows_outside, trim_stored
from tandem.protocol import Batch
from tandem.protocol.sequences import concat_sequences, trim_padding
from tandem.rl.scoring import SEQUENCE_SCORE
from tandem.rl.stages.base import register_step_stage


def filters_groups(config: Any) -> bool:
    """Whether the run filters its draws' groups (``algorithm.filter_groups.enable``)."""
    return config.algorithm.filter_groups.enable


def check_group_filter(config: Any, plan: Any) -> None:
    """The group filter compares a prompt's responses: ``rollout.n >= 2``."""
    if config.rollout.n < 2:
        raise ValueError("algorithm.filter_groups.enable needs rollout.n >= 2")


@register_step_stage(
    "dynamic_sampling", "collect", applies=filters_groups, stored=True, rule=check_group_filter
)
def dynamic_sampling(trainer: Any, timings: dict[str, float]) -> tuple[Batch | BatchRef, dict[str, float]]:
    """``train_batch_size`` prompt groups, the informative ones of the step's draws first; metrics
    ``dynamic_sampling/gen_rounds`` (draws made) and ``dynamic_sampling/informative_groups``."""
    config = trainer.config
    wanted, n = config.data.train_batch_size, config.rollout.n
    dynamic = config.algorithm.filter_groups
    kept: list[Any] = []
    spare: list[Any] = []
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
    batch = _first_rows([b for b in kept + spare if len(b)], wanted * n, trainer)
    reward_metrics["dynamic_sampling/gen_rounds"] = float(draw)
    reward_metrics["dynamic_sampling/informative_groups"] = float(have)
    return batch, {**metrics, **reward_metrics}


def _first_rows(pieces: list[Any], rows: int, trainer: Any) -> Batch | BatchRef:
    """The first ``rows`` rows of ``pieces`` joined, trimmed to their widths; for stored draws, the
    blocks none of those rows lives in are released (by the actor's ranks, who end the step)."""
    if not isinstance(pieces[0], BatchRef):
        pad_id = trainer.tokenizer.pad_token_id
        return trim_padding(concat_sequences(pieces, pad_id)[:rows], pad_id)
    pool = concat_stored(pieces)
    batch = trim_stored(pool[:rows])
    dropped = rows_outside(pool, batch)
    if len(dropped):
        trainer.workers.release_refs(dropped)
    return batch


def groups_with_spread(batch: Batch | BatchRef, n: int, metric: str) -> torch.Tensor:
    """``[G]`` bool: groups of ``n`` consecutive rows whose ``metric`` (``score``, ``raw_score`` or
    ``acc``) is not all equal; a stored draw's score is its inline ``sequence_score [B]``."""
    if metric == "score":
        values = batch[SEQUENCE_SCORE] if isinstance(batch, BatchRef) else batch["token_level_scores"].sum(-1)
    else:
        values = batch[metric]
    return values.view(-1, n).std(dim=1) > 0
