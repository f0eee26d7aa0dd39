"""A tandem plugin: GRPO's advantage written out with a loop over the prompt groups.

    tandem train --plugin examples/plugins/advantage_estimator.py algorithm.adv_estimator=grpo_loop ...

``requires=("group_ids",)`` tells the trainer what the estimator reads: with it, the run asks
``rollout.n >= 2`` and passes each response's prompt group, as it does for the built-in ``grpo``.
"""

import torch

from tandem.algos import AdvantageConfig, AdvantageInput, AdvantageOutput, register_advantage_estimator


@register_advantage_estimator("grpo_loop", requires=("group_ids",))
def grpo_loop(inputs: AdvantageInput, config: AdvantageConfig) -> AdvantageOutput:
    """``(s_i - mean_g) / (std_g + eps)`` per prompt group g (GRPO). Shapes: ``[B, R] -> [B, R]``."""
    scores = inputs.scores  # [B]: each response's summed token rewards
    advantage = torch.empty_like(scores)
    for group in inputs.group_ids.unique():
        members = inputs.group_ids == group
        group_scores = scores[members]
        if len(group_scores) == 1:  # nothing to compare with: the raw score, as grpo does
            advantage[members] = group_scores
            continue
        centred = group_scores - group_scores.mean()
        if config.norm_adv_by_std:  # False: Dr. GRPO
            centred = centred / (group_scores.std() + config.epsilon)  # the unbiased std
        advantage[members] = centred
    per_token = advantage.unsqueeze(-1) * inputs.response_mask.to(scores.dtype)  # [B, R]
    return AdvantageOutput(advantages=per_token, returns=per_token)
