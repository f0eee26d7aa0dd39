"""ReMax's greedy baselines: each draw's prompts answered greedily and scored, when the advantage
estimator reads ``reward_baselines`` (its ``requires=``).

A draw kept in the data plane (a ``BatchRef``) keeps its greedy responses there too, where the
batch source can (``generate_to_store``: the ``sync`` pipeline's workers, the asynchronous
pipelines' replicas): they are scored on the texts the generating ranks or replicas decoded, only
the per-row scores reach the controller, and their blocks are released once scored (by the
trainer's ranks, as the draw's are)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.dataplane import BatchRef
from tandem.protocol import Batch
from tandem.rl.metrics import timed
from tandem.rl.scoring import SEQUENCE_SCORE
from tandem.rl.stages.base import register_step_stage


def needs_greedy_baseline(config: Any) -> bool:
    """Whether the advantage estimator reads a greedy baseline (``reward_baselines``: ReMax)."""
    return config.algorithm.needs_greedy_baseline


def replay_refusal(config: Any) -> str:
    """Why a replay (which runs no rollout engine) cannot run ReMax's step."""
    return f"algorithm.adv_estimator={config.algorithm.adv_estimator} generates greedy baselines each step"


@register_step_stage(
    "greedy_baseline", "draw", applies=needs_greedy_baseline, order=10, stored=True, replay=replay_refusal
)
def greedy_baseline(trainer: Any, scored: Batch | BatchRef, timings: dict[str, float]) -> Batch | BatchRef:
    """``reward_baselines [B]``: the score of each group's greedy response, repeated over the
    group's ``n`` rows. The greedy responses come from the weights the engines hold: the trainer's
    latest (sync), or the replicas' (asynchronous modes), which differ from the sampled responses'
    by at most the staleness bound. A baseline only has to be independent of the response it is
    subtracted from, which both are."""
    n = trainer.config.rollout.n
    with timed(timings, "gen_greedy"):
        indices = [int(i) for i in scored["index"][::n]]
        baselines = greedy_scores(trainer, indices, stored=isinstance(scored, BatchRef)).repeat_interleave(n)
    if isinstance(scored, BatchRef):
        return BatchRef(
            scored.scalars.assign(tensors={"reward_baselines": baselines}), scored.parts, scored.schema
        )
    return scored.assign(tensors={"reward_baselines": baselines})


def greedy_scores(trainer: Any, indices: list[int], stored: bool) -> torch.Tensor:
    """``[G]`` float32: the score of the greedy response to each training prompt of ``indices``;
    with ``stored`` (and a source that keeps generations) the request names the prompts' places
    (the ranks or replicas read them: :meth:`RLDataset.requests`), the responses stay where they
    were generated and are released once scored (agent episodes too, scored on their
    conversations)."""
    source, seeds, sampling = trainer.rollout, [0] * len(indices), trainer.config.rollout.sampling(0.0)
    keeps = getattr(source, "generate_to_store", None)
    if not stored or keeps is None:
        greedy = source.generate(trainer.train_data.collate(indices), seeds, sampling, None)
        return trainer.score(greedy, training=False)[0]["token_level_scores"].sum(-1)
    greedy = keeps(trainer.train_data.requests(indices), seeds, sampling)
    try:
        return trainer.score(greedy, training=False)[0][SEQUENCE_SCORE]
    finally:
        trainer.workers.release_refs(greedy)
