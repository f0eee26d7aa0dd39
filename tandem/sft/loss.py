"""The SFT loss: mean negative log-likelihood of the assistant tokens."""

from __future__ import annotations

import torch

from tandem.algos.aggregation import LossNormalizer, aggregate_loss
from tandem.engine.base import TokenOutputs
from tandem.protocol import Batch


def sft_loss(
    micro: Batch, outputs: TokenOutputs, normalizer: LossNormalizer | None = None
) -> tuple[torch.Tensor, dict]:
    """``-sum(log p(assistant tokens)) / global token count`` for this micro-batch.

    Shapes: ``loss_mask, outputs.log_probs: [B, S]`` -> scalar. With ``normalizer`` the global
    counts of the whole step make micro-batch shares add up to the full-batch loss.
    """
    loss_mask = micro["loss_mask"]
    loss = aggregate_loss(-outputs.log_probs, loss_mask, "token-mean", normalizer)
    return loss, {"tokens": loss_mask.sum().to(torch.float32)}
