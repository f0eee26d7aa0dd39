"""The DPO step's loss over a micro-batch of whole pairs, and the metrics TRL users know.

Each micro-batch holds both rows of each of its pairs (``micro_batch_unit``, see
:func:`tandem.dpo.data.PreferenceDataset.collate`). The loss returns its share of the step's
mean: the sum of its pairs' losses over ``total_pairs`` (the NLL terms of RPO, ``sft``, CPO and
ORPO divide by the step's ``chosen_tokens``), so the shares of all micro-batches add up to the
loss of the whole batch, however it was split. Metrics come back as sums over the
micro-batch's pairs; :func:`pair_metrics` turns the step's sums into means.

Each response enters the loss as one number, :func:`row_summaries`: its log-prob summed over
its tokens, or with LD-DPO's ``ld_alpha`` the sum over the tokens both responses of the pair
have plus ``ld_alpha`` times the sum over the longer one's remaining tokens. The reference's
log-probs are summarised the same way (the trainer scores them with this function too).
"""

from __future__ import annotations

import torch

from tandem.algos.preference import PreferenceInput, PreferenceLossConfig, compute_preference_loss
from tandem.engine.base import TokenOutputs
from tandem.engine.moe_routing import METRIC_PREFIX
from tandem.protocol import Batch

SUMMED = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_rows(micro: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices ``[P]`` of the chosen and the rejected response of each pair, matched by pair;
    raises when a pair's two rows are not both in ``micro``."""
    chosen = micro["chosen"].bool()
    pairs = micro["pair"]
    chosen_rows = chosen.nonzero().flatten()
    rejected_rows = (~chosen).nonzero().flatten()
    chosen_rows = chosen_rows[torch.argsort(pairs[chosen_rows])]
    rejected_rows = rejected_rows[torch.argsort(pairs[rejected_rows])]
    if not torch.equal(pairs[chosen_rows], pairs[rejected_rows]):
        raise ValueError(
            "a micro-batch holds one row of a pair without the other (micro_batch_unit was not honoured)"
        )
    return chosen_rows, rejected_rows


def shared_token_mask(rows: Batch) -> torch.Tensor:
    """``[2P, S]``: each response's tokens up to the length of its pair's shorter response
    (LD-DPO's shared part); ``rows`` holds ``loss_mask``, ``pair`` and ``chosen``."""
    mask = rows["loss_mask"]
    lengths = mask.sum(-1)
    chosen, rejected = pair_rows(rows)
    shared = torch.zeros_like(lengths)
    shortest = torch.minimum(lengths[chosen], lengths[rejected])
    shared[chosen], shared[rejected] = shortest, shortest
    position = mask.cumsum(-1)  # 1 at a response's first token
    return mask.bool() & (position <= shared[:, None])


def wpo_weights(outputs: TokenOutputs, mask: torch.Tensor) -> torch.Tensor:
    """WPO's weight ``[B]`` of each row, detached: ``exp`` of the mean over its ``mask [B, S]``
    tokens of ``log p(y_t) - log Σ_v p(v)²`` (the probability aligned to the policy's own
    sampling), from ``outputs.log_probs`` and ``outputs.sum_pi_squared``."""
    assert outputs.log_probs is not None and outputs.sum_pi_squared is not None
    keep = mask.bool()
    aligned = outputs.log_probs.detach() - torch.log(outputs.sum_pi_squared.detach().clamp(min=1e-30))
    aligned = torch.where(keep, aligned, torch.zeros_like(aligned))
    return torch.exp(aligned.sum(-1) / keep.sum(-1).clamp(min=1))


def row_summaries(rows: Batch, outputs: TokenOutputs, ld_alpha: float | None, with_weights: bool) -> Batch:
    """``score [2P]``: each response's summed log-prob (LD-desensitised when ``ld_alpha`` is
    set; a reward model's score), and ``with_weights`` WPO's ``wpo_weight [2P]``."""
    mask = rows["loss_mask"]
    score = outputs.sequence_summary(mask)
    if ld_alpha is not None and outputs.scores is None:
        shared = outputs.sequence_summary(shared_token_mask(rows))
        score = shared + ld_alpha * (score - shared)
    summaries = {"score": score}
    if with_weights:
        summaries["wpo_weight"] = wpo_weights(outputs, mask)
    return Batch(summaries)


def preference_loss(
    micro: Batch,
    outputs: TokenOutputs,
    config: PreferenceLossConfig,
    total_pairs: int,
    chosen_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's preference loss (see the module docstring).

    Shapes: ``outputs.log_probs, loss_mask: [2P, S]`` (``outputs.sum_pi_squared [2P, S]`` with
    ``use_weighting``); ``ref_log_prob: [2P]`` (the reference's :func:`row_summaries` score;
    absent for reference-free losses). With a reward model's ``outputs.scores`` (``tandem rm``)
    each response's score stands where its log-prob would.
    """
    return summed_preference_loss(
        micro,
        row_summaries(micro, outputs, config.ld_alpha, config.use_weighting),
        config,
        total_pairs,
        chosen_tokens,
    )


def summed_preference_loss(
    rows: Batch,
    summaries: Batch,
    config: PreferenceLossConfig,
    total_pairs: int,
    chosen_tokens: float,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`preference_loss` from each row's :func:`row_summaries` (``score [2P]``, and
    ``wpo_weight [2P]`` with ``use_weighting``: what the controller gets back when it scores
    validation pairs); ``rows`` holds ``pair``, ``chosen``, (when the loss needs it)
    ``ref_log_prob`` and, unless ``lengths [2P]`` (each row's response tokens) is given,
    ``loss_mask``."""
    log_probs = summaries["score"]
    lengths = (rows["loss_mask"].sum(-1) if lengths is None else lengths).to(log_probs.dtype)
    chosen, rejected = pair_rows(rows)
    reference = rows["ref_log_prob"] if config.needs_reference else torch.zeros_like(log_probs)
    weights = summaries["wpo_weight"] if config.use_weighting else None
    inputs = PreferenceInput(
        policy_chosen=log_probs[chosen],
        policy_rejected=log_probs[rejected],
        reference_chosen=reference[chosen],
        reference_rejected=reference[rejected],
        chosen_lengths=lengths[chosen],
        rejected_lengths=lengths[rejected],
        mean_chosen_length=chosen_tokens / total_pairs,
        chosen_weights=None if weights is None else weights[chosen],
        rejected_weights=None if weights is None else weights[rejected],
    )
    output = compute_preference_loss(inputs, config)
    chosen_rewards, rejected_rewards = output.chosen_rewards, output.rejected_rewards
    metrics = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": inputs.policy_chosen.detach().sum(),
        "logps/rejected": inputs.policy_rejected.detach().sum(),
        "pairs": torch.tensor(float(len(chosen))),
        **{name: values.sum() for name, values in output.metrics.items()},
    }
    return output.loss.sum() / total_pairs, metrics


def pair_metrics(per_micro: dict[str, list[float]], chosen_tokens: float | None = None) -> dict[str, float]:
    """The step's metrics from the micro-batches' sums: means over pairs. A mixture-of-experts
    policy's routing metrics (``moe/*``) are each micro-batch's mean already: their mean over the
    micro-batches.

    ``chosen_tokens`` is accepted for callers that pass it and not needed: a pair's ``nll_loss``
    is already its share of the token mean."""
    pairs = sum(per_micro["pairs"])
    return {
        name: sum(values) / (len(values) if name.startswith(METRIC_PREFIX) else pairs)
        for name, values in per_micro.items()
        if name != "pairs"
    }
