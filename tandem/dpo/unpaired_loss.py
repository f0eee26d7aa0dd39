"""The KTO step's loss over a micro-batch of unpaired rows, and TRL's KTO metric names.

The loss returns its share of the step's mean over rows (its rows' losses over ``total_rows``),
so the shares of all micro-batches add up to the loss of the whole batch. KTO's reference
point ``kl`` is one number for the step, estimated before it by the trainer from the rows'
mismatched completions (:func:`~tandem.algos.preference.kto_kl_estimate`), as TRL does under
``no_grad``. Metrics come back as sums;
:func:`unpaired_metrics` turns the step's sums into TRL's means (``rewards/chosen`` over
desirable rows, ``rewards/rejected`` over undesirable ones, ``rewards/margins`` their
difference, ``logps/*`` likewise).
"""

from __future__ import annotations

import torch

from tandem.algos.preference import PreferenceLossConfig, UnpairedInput, compute_unpaired_loss
from tandem.engine.base import TokenOutputs
from tandem.protocol import Batch


def unpaired_loss(
    micro: Batch, outputs: TokenOutputs, config: PreferenceLossConfig, total_rows: int, kl: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the step's loss. Shapes: ``outputs.log_probs, loss_mask
    [N, S]``; ``ref_log_prob, desirable [N]``; ``kl`` 0-d."""
    return summed_unpaired_loss(micro, outputs.sequence_summary(micro["loss_mask"]), config, total_rows, kl)


def summed_unpaired_loss(
    rows: Batch, log_probs: torch.Tensor, config: PreferenceLossConfig, total_rows: int, kl: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`unpaired_loss` from each row's summed completion log-prob ``log_probs [N]``."""
    desirable = rows["desirable"].bool()
    inputs = UnpairedInput(log_probs, rows["ref_log_prob"].to(log_probs), desirable, kl.to(log_probs))
    output = compute_unpaired_loss(inputs, config)
    good = desirable.to(log_probs.dtype)
    logps = log_probs.detach()
    metrics = {
        "rewards/chosen": (output.rewards * good).sum(),
        "rewards/rejected": (output.rewards * (1 - good)).sum(),
        "logps/chosen": (logps * good).sum(),
        "logps/rejected": (logps * (1 - good)).sum(),
        "desirable": good.sum(),
        "undesirable": (1 - good).sum(),
    }
    return output.loss.sum() / total_rows, metrics


def unpaired_metrics(per_micro: dict[str, list[float]]) -> dict[str, float]:
    """The step's means from the micro-batches' sums (a side without rows is left out, as in TRL)."""
    counts = {"chosen": sum(per_micro["desirable"]), "rejected": sum(per_micro["undesirable"])}
    metrics = {}
    for side, count in counts.items():
        if count:
            metrics[f"rewards/{side}"] = sum(per_micro[f"rewards/{side}"]) / count
            metrics[f"logps/{side}"] = sum(per_micro[f"logps/{side}"]) / count
    if all(counts.values()):
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics
