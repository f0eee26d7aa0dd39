"""Online DPO's pairs: each prompt group's best- and worst-scored responses.

The ``n`` responses of a prompt are consecutive rows of the scored batch. For each group the
response with the highest score is *chosen* and the one with the lowest *rejected*; a group
whose responses all scored the same states no preference and is left out (counted). The pairs
come back in the layout :func:`tandem.dpo.loss.preference_loss` reads — chosen then rejected
rows, ``loss_mask`` over the response columns, ``pair``, ``chosen`` and ``micro_batch_unit``
(so no micro-batch splits a pair) — and their number is cut to a multiple of the data-parallel
size, so each worker receives whole pairs.

The rows are picked from the per-row scores alone (:func:`best_worst_rows`), so the same pairs
come out of the controller's ``Batch`` (:func:`best_worst_pairs`) and, with the step's tokens in
the data plane, of its ``BatchRef`` by rewriting its row indices (:func:`stored_pairs`: the pair
columns inline, ``[2P]`` each). Each update rank then makes, on its own rows, the per-token
``loss_mask`` and the reference's sums the controller's path makes (:func:`with_pair_fields`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.dataplane import BatchRef
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.protocol import Batch

PAIR_COLUMNS = ("pair", "chosen", "micro_batch_unit")  # [2P] int64 each, inline with references
PAIR_UPDATE_READS = (*FORWARD_FIELDS, "response_mask", "ref_log_probs", *PAIR_COLUMNS)  # the update's


def best_worst_rows(
    scores: torch.Tensor, n: int, world_size: int
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The rows of the pairs, ``[2P]`` int64 (each pair's chosen row, then its rejected one; None
    when no group has a preference), from ``scores [G * n]`` (each row's sequence score), and the
    pairs' metrics."""
    scores = scores.view(-1, n)  # [G, n]
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
    return torch.stack([groups * n + best[groups], groups * n + worst[groups]], dim=1).flatten(), metrics


def pair_columns(pairs: int) -> dict[str, torch.Tensor]:
    """The per-row columns of ``pairs`` pairs laid out chosen, rejected: ``pair``, ``chosen`` and
    ``micro_batch_unit`` (``[2P]`` int64 each)."""
    pair_ids = torch.arange(pairs).repeat_interleave(2)
    return {
        "pair": pair_ids,
        "chosen": torch.tensor([1, 0] * pairs, dtype=torch.long),
        "micro_batch_unit": pair_ids,
    }


def pair_loss_mask(prompts: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``loss_mask [2P, Lp + R]`` int64: 0 over the prompt columns (``prompts [2P, Lp]``), the
    response mask (``[2P, R]``) over the response columns."""
    return torch.cat([torch.zeros_like(prompts), response_mask.long()], dim=1)


def best_worst_pairs(batch: Batch, n: int, world_size: int) -> tuple[Batch | None, dict[str, float]]:
    """The pair batch ``[2P, ...]`` (None when no group has a preference) and its metrics.

    Shapes: ``token_level_scores, response_mask: [G * n, R]``; ``prompts: [G * n, Lp]``.
    """
    rows, metrics = best_worst_rows(batch["token_level_scores"].sum(-1), n, world_size)
    if rows is None:
        return None, metrics
    pairs = batch[rows]
    loss_mask = pair_loss_mask(pairs["prompts"], pairs["response_mask"])
    return pairs.assign(tensors={"loss_mask": loss_mask, **pair_columns(len(rows) // 2)}), metrics


def stored_pairs(step: BatchRef, rows: torch.Tensor) -> BatchRef:
    """The pairs as references: ``step``'s ``rows [2P]`` (indices rewritten, nothing fetched) with
    the pair columns inline."""
    pairs = step[rows]
    scalars = pairs.scalars.assign(tensors=pair_columns(len(rows) // 2))
    return BatchRef(scalars, pairs.parts, pairs.schema)


def with_reference_sums(pairs: Batch) -> Batch:
    """``pairs`` with ``ref_log_prob [2P]``: the summed response log-probs under the reference."""
    return pairs.assign(tensors={"ref_log_prob": (pairs["ref_log_probs"] * pairs["response_mask"]).sum(-1)})


def with_pair_fields(pairs: Batch) -> Batch:
    """``pairs`` (an update rank's rows) with what the controller's path adds to them and a stored
    step's pairs lack: ``loss_mask`` and, with the reference's log-probs, ``ref_log_prob`` (row by
    row, the same ops as :func:`best_worst_pairs` and :func:`with_reference_sums`)."""
    if "loss_mask" not in pairs:
        pairs = pairs.assign(tensors={"loss_mask": pair_loss_mask(pairs["prompts"], pairs["response_mask"])})
    if "ref_log_probs" in pairs and "ref_log_prob" not in pairs:
        pairs = with_reference_sums(pairs)
    return pairs


Stage = Callable[[Any], BatchRef]  # a group's bound method: a BatchRef in, one out


class StoredPairs:
    """The pairs' rows as references, for the plan's passes (the reference's log-probs): each pass
    runs on them and its outputs stay on its ranks, released with the step (``step``, a
    :class:`tandem.rl.step_data.RefStep`)."""

    def __init__(self, pairs: BatchRef, step: Any) -> None:
        self.first = pairs
        self.step = step
        self.kept: list[BatchRef] = []

    def stage(self, group: Any, method: Stage, joined: bool = False) -> None:
        self.kept.append(self.step.keep(group, method(self.joined() if joined else self.first)))

    def joined(self) -> BatchRef:
        """The pairs joined with the passes' outputs (references only)."""
        pairs = self.first
        for output in self.kept:
            pairs = pairs.union(output)
        return pairs

    def for_update(self) -> BatchRef:
        """:meth:`joined`, only the fields the preference update reads (:data:`PAIR_UPDATE_READS`)."""
        pairs = self.joined()
        return pairs.select([f for f in PAIR_UPDATE_READS if f in pairs])
