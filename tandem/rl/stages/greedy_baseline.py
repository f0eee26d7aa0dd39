"""ReMax's greedy baselines: each draw's prompts answered greedily and scored, when the advantage
estimator reads ``reward_baselines`` (its ``requires=``)."""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.rl.metrics import timed
from tandem.rl.stages.base import register_step_stage


@register_step_stage(
    "greedy_baseline", "draw", applies=lambda config: config.algorithm.needs_greedy_baseline, order=10
)
def greedy_baseline(trainer: Any, scored: Batch, timings: dict[str, float]) -> Batch:
    """``reward_baselines [B]``: the score of each group's greedy response, repeated over the
    group's ``n`` rows. The greedy responses come from the weights the engines hold: the trainer's
    latest (sync), or the replicas' (asynchronous modes), which differ from the sampled responses'
    by at most the staleness bound. A baseline only has to be independent of the response it is
    subtracted from, which both are."""
    n = trainer.config.rollout.n
    with timed(timings, "gen_greedy"):
        prompts = trainer.train_data.collate([int(i) for i in scored["index"][::n]])
        sampling = trainer.config.rollout.sampling(0.0)
        greedy = trainer.rollout.generate(prompts, [0] * len(prompts), sampling, None)
        baselines = trainer.score(greedy, training=False)[0]["token_level_scores"].sum(-1)
    return scored.assign(tensors={"reward_baselines": baselines.repeat_interleave(n)})
