"""A tandem plugin: a step stage that charges each sampled response a cost per token.

    tandem train --plugin examples/plugins/step_stage.py algorithm.adv_estimator=grpo_token_cost ...

A step stage is a named piece of the RL step, in a slot (``tandem.rl.stages.base`` lists them).
This one is a ``draw`` stage: it runs on every scored draw, before DAPO's filter looks at it. It
applies when the run picks this file's estimator, ``grpo_token_cost`` (GRPO's own math): a
plugin's stage is switched on by a name the plugin registers, as ReMax's is by its estimator.
"""

import dataclasses

import torch

from tandem.algos import (
    AdvantageConfig,
    AdvantageInput,
    AdvantageOutput,
    compute_advantage,
    register_advantage_estimator,
)
from tandem.protocol import Batch
from tandem.rl.stages import register_step_stage

COST = 0.05  # score per response token


@register_advantage_estimator("grpo_token_cost", requires=("group_ids",))
def grpo_token_cost(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """GRPO's advantages, of the scores the ``token_cost`` stage lowered."""
    return compute_advantage(inputs, dataclasses.replace(config, estimator="grpo"))


@register_step_stage(
    "token_cost", "draw", applies=lambda config: config.algorithm.adv_estimator == "grpo_token_cost"
)
def token_cost(trainer, scored: Batch, timings: dict[str, float]) -> Batch:
    """Each response's score lowered by ``COST`` per response token, on the token that holds it.

    Shapes: ``token_level_scores, response_mask: [B, R]``.
    """
    mask = scored["response_mask"]
    lengths = mask.sum(-1)  # [B]
    last = mask.cumsum(-1).argmax(-1)  # [B]: each row's last response token, where scoring put its score
    scores = scored["token_level_scores"].clone()
    scores[torch.arange(len(scores)), last] -= COST * lengths.to(scores.dtype)
    return scored.assign(tensors={"token_level_scores": scores})
