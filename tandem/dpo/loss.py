"""The DPO step's loss over a micro-batch of whole pairs, and the metrics TRL users know.

Each micro-batch holds both rows of each of its pairs (``micro_batch_unit``, see
:func:`tandem.dpo.data.PreferenceDataset.collate`). The loss returns its share of the step's
mean: the sum of its pairs' losses over ``total_pairs`` (plus, with RPO, its chosen tokens'
NLL over ``chosen_tokens``), so the shares of all micro-batches add up to the loss of the
whole batch, however it was split. Metrics come back as sums over the micro-batch's pairs;
:func:`pair_metrics` turns the step's sums into means.
"""

from __future__ import annotations

import torch

from tandem.algos.preference import PreferenceInput, PreferenceLossConfig, compute_preference_loss
from tandem.engine.base import TokenOutputs
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


def preference_loss(
    micro: Batch,
    outputs: TokenOutputs,
    config: PreferenceLossConfig,
    total_pairs: int,
    chosen_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's preference loss (see the module docstring).

    Shapes: ``outputs.log_probs, loss_mask: [2P, S]``; ``ref_log_prob: [2P]`` (summed response
    log-probs under the reference; absent for reference-free losses). With a reward model's
    ``outputs.scores`` (``tandem rm``) each response's score stands where its log-prob would.
    """
    return summed_preference_loss(
        micro, outputs.sequence_summary(micro["loss_mask"]), config, total_pairs, chosen_tokens
    )


def summed_preference_loss(
    rows: Batch,
    log_probs: torch.Tensor,
    config: PreferenceLossConfig,
    total_pairs: int,
    chosen_tokens: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`preference_loss` from each row's summed response log-prob ``log_probs [2P]``
    (what the controller gets back when it scores validation pairs); ``rows`` holds
    ``loss_mask``, ``pair``, ``chosen`` and (when the loss needs it) ``ref_log_prob``."""
    lengths = rows["loss_mask"].sum(-1).to(log_probs.dtype)
    chosen, rejected = pair_rows(rows)
    reference = rows["ref_log_prob"] if config.needs_reference else torch.zeros_like(log_probs)
    inputs = PreferenceInput(
        policy_chosen=log_probs[chosen],
        policy_rejected=log_probs[rejected],
        reference_chosen=reference[chosen],
        reference_rejected=reference[rejected],
        chosen_lengths=lengths[chosen],
        rejected_lengths=lengths[rejected],
    )
    losses, chosen_rewards, rejected_rewards = compute_preference_loss(inputs, config)
    loss = losses.sum() / total_pairs
    metrics = {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": inputs.policy_chosen.detach().sum(),
        "logps/rejected": inputs.policy_rejected.detach().sum(),
        "pairs": torch.tensor(float(len(chosen))),
    }
    if config.rpo_alpha:
        nll = -inputs.policy_chosen.sum() / chosen_tokens
        loss = loss + config.rpo_alpha * nll
        metrics["nll_loss"] = nll.detach() * chosen_tokens  # summed; averaged by pair_metrics
    return loss, metrics


def pair_metrics(per_micro: dict[str, list[float]], chosen_tokens: float) -> dict[str, float]:
    """The step's metrics from the micro-batches' sums: means over pairs (``nll_loss`` over chosen tokens)."""
    pairs = sum(per_micro["pairs"])
    metrics = {name: sum(per_micro[name]) / pairs for name in SUMMED}
    if "nll_loss" in per_micro:
        metrics["nll_loss"] = sum(per_micro["nll_loss"]) / chosen_tokens
    return metrics
