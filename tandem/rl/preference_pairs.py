"""Online DPO's pairs: each prompt group's best- and worst-scored responses.

The ``n`` responses of a prompt are consecutive rows of the scored batch. For each group the
response with the highest score is *chosen* and the one with the lowest *rejected*; a group
whose responses all scored the same states no preference and is left out (counted). The pairs
come back in the layout :func:`tandem.dpo.loss.preference_loss` reads — chosen then rejected
rows, ``loss_mask`` over the response columns, ``pair``, ``chosen`` and ``micro_batch_unit``
(so no micro-batch splits a pair) — and their number is cut to a multiple of the data-parallel
size, so each worker receives whole pairs.
"""

from __future__ import annotations

import torch

from tandem.protocol import Batch


def best_worst_pairs(batch: Batch, n: int, world_size: int) -> tuple[Batch | None, dict[str, float]]:
    """The pair batch ``[2P, ...]`` (None when no group has a preference) and its metrics.

    Shapes: ``token_level_scores, response_mask: [G * n, R]``; ``prompts: [G * n, Lp]``.
    """
    scores = batch["token_level_scores"].sum(-1).view(-1, n)  # [G, n]
    best, worst = scores.argmax(-1), scores.argmin(-1)
    groups = (scores.max(-1).values > scores.min(-1).values).nonzero().flatten()
    usable = len(groups) - len(groups) % world_size
    groups = groups[:usable]
    metrics = {
        "online_dpo/groups_with_preference": float(len(groups)) / scores.shape[0],
        "online_dpo/chosen_score": float(scores[groups, best[groups]].mean()) if usable else 0.0,
        "online_dpo/rejected_score": float(scores[groups, worst[groups]].mean()) if usable else 0.0,
    }
    if not usable:
        return None, metrics
    rows = torch.stack([groups * n + best[groups], groups * n + worst[groups]], dim=1).flatten()  # [2P]
    pairs = batch[rows]
    loss_mask = torch.cat([torch.zeros_like(pairs["prompts"]), pairs["response_mask"].long()], dim=1)
    pair_ids = torch.arange(usable).repeat_interleave(2)
    return (
        pairs.assign(
            tensors={
                "loss_mask": loss_mask,
                "pair": pair_ids,
                "chosen": torch.tensor([1, 0] * usable, dtype=torch.long),
                "micro_batch_unit": pair_ids,
            }
        ),
        metrics,
    )


def with_reference_sums(pairs: Batch) -> Batch:
    """``pairs`` with ``ref_log_prob [2P]``: the summed response log-probs under the reference."""
    return pairs.assign(tensors={"ref_log_prob": (pairs["ref_log_probs"] * pairs["response_mask"]).sum(-1)})
