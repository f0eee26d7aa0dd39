"""Rows that hold several sequences end to end: an agent program's split episode, each segment
(a request that did not extend the previous reply) its own conversation, all in one training row
(:meth:`tandem.agents.program.recorder.EpisodeRecord.row`).

A row's ``position_ids`` restart at 0 where each later segment starts, which is how the trainer
tells the segments apart (:func:`tandem.engine.packing.pack_sequences`). A trajectory says where
they start (``Trajectory.segment_starts``: offsets into its ``token_ids``); between a rollout
replica and the controller the starts travel as a per-token flag beside ``token_mask``
(:data:`SEGMENT_START_FIELD`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from tandem.agents.trajectory import Trajectory

SEGMENT_START_FIELD = "segment_start"  # [sum of response lengths] int64: 1 where a later segment starts


def segment_positions(
    attention_mask: torch.Tensor, segment_starts: Sequence[Sequence[int]], prompt_width: int
) -> torch.Tensor:
    """``position_ids [B, P + R]`` of rows whose response columns (from ``prompt_width``) hold
    later segments starting at ``segment_starts[b]`` (offsets into the response): each token's
    position in its own segment; 0 where a segment starts and on padding (``attention_mask``)."""
    mask = attention_mask.long()
    positions = ((mask.cumsum(-1) - 1) * mask).clamp(min=0)
    for row, starts in enumerate(segment_starts):
        for start in starts:  # in order: each restart counts from the previous one's positions
            column = prompt_width + start
            positions[row, column:] -= positions[row, column].clone()
    return positions * mask


def segment_start_flags(trajectories: Sequence[Trajectory]) -> torch.Tensor:
    """The trajectories' responses end to end, ``[sum of len(token_ids)]`` int64: 1 at each later
    segment's first token, 0 elsewhere."""
    flags = []
    for trajectory in trajectories:
        row = [0] * len(trajectory.token_ids)
        for start in trajectory.segment_starts:
            row[start] = 1
        flags += row
    return torch.tensor(flags, dtype=torch.int64)


def segment_starts(fields: Mapping[str, torch.Tensor], start: int, end: int) -> list[int]:
    """The later segments' starts of the response at ``start:end`` of a group's stored fields
    (none where the group was stored without :data:`SEGMENT_START_FIELD`)."""
    if SEGMENT_START_FIELD not in fields:
        return []
    return fields[SEGMENT_START_FIELD][start:end].nonzero().flatten().tolist()


def with_segment_positions(
    tensors: dict[str, torch.Tensor], starts: Sequence[Sequence[int]]
) -> dict[str, torch.Tensor]:
    """``tensors`` (:func:`tandem.protocol.sequences.sequence_tensors`' fields) with ``position_ids``
    restarting where each row's later segments start (``starts[b]``, offsets into its response);
    unchanged when no row has one."""
    if not any(starts):
        return tensors
    positions = segment_positions(tensors["attention_mask"], starts, tensors["prompts"].shape[1])
    return {**tensors, "position_ids": positions}
