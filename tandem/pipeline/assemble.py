"""The training rows of finished prompt groups, built on the controller from their metadata.

:func:`assemble_batch` maps each group's sample files (:mod:`tandem.pipeline.sample_store`) and
copies the responses once, into the padded batch; :func:`assemble_stored` leaves the rows in the
replicas' data-plane blocks (:mod:`tandem.pipeline.group_blocks`) and returns a ``BatchRef`` to
them. Both take the prompts' columns from the :class:`~tandem.pipeline.requests.PromptRows`.
"""

from __future__ import annotations

from typing import Any

from tandem.agents.segments import segment_starts, with_segment_positions
from tandem.dataplane import BatchRef
from tandem.pipeline.group_blocks import spans_of
from tandem.pipeline.provenance import provenance_columns
from tandem.pipeline.requests import PromptRows
from tandem.pipeline.sample_queue import GroupMeta
from tandem.pipeline.sample_store import read_fields, release
from tandem.pipeline.stored_rollout import trim_stored
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.images import IMAGES_FIELD
from tandem.protocol.sequences import sequence_tensors, trim_padding


def assemble_batch(groups: list[GroupMeta], prompt_rows: PromptRows, n: int, pad_id: int) -> Batch:
    """The training rows of ``groups`` (``n`` responses each): their prompts from ``prompt_rows`` (an
    agent episode's own prompt, rendered with the tools' schemas) and their responses pulled from
    the sample store (whose files are released). Each response is a view of the mapped file until
    it is copied once, into the padded batch. Every row carries its provenance
    (:mod:`tandem.pipeline.provenance`)."""
    prompts = prompt_rows.collate([g.index for g in groups]).repeat(n, interleave=True)
    prompt_ids: list[Any] = list(prompts["prompt_ids"])
    completions: list[Completion] = []
    starts: list[list[int]] = []  # an agent episode's later segments' starts in its response
    for g, group in enumerate(groups):
        fields = read_fields(group.ref)
        spans = spans_of(fields["lengths"])
        prompt_spans = spans_of(fields["prompt_lengths"]) if group.episodes else []
        routed_spans = spans_of(fields["routed_lengths"]) if "routed_lengths" in fields else []
        for i, (start, end) in enumerate(spans):
            completions.append(
                Completion(
                    f"{group.uid}/{i}",
                    (),
                    fields["token_ids"][start:end],  # type: ignore[arg-type]
                    fields["log_probs"][start:end],  # type: ignore[arg-type]
                    fields["versions"][start:end],  # type: ignore[arg-type]
                    group.finish_reasons[i],  # type: ignore[arg-type]
                    token_mask=fields["token_mask"][start:end] if group.episodes else None,  # type: ignore[arg-type]
                    routed_experts=fields["routed_experts"][slice(*routed_spans[i])]
                    if routed_spans
                    else None,
                )
            )
            if group.episodes:
                begin, stop = prompt_spans[i]
                prompt_ids[g * n + i] = fields["prompt_ids"][begin:stop].tolist()
            starts.append(segment_starts(fields, start, end) if group.episodes else [])
        release(group.ref)
    tensors = with_segment_positions(sequence_tensors(prompt_ids, completions, pad_id), starts)
    non_tensors: dict[str, list] = {
        "uid": [g.uid for g in groups for _ in range(n)],
        "finish_reason": [c.finish_reason for c in completions],
        **provenance_columns(groups),
        **episode_columns(groups),
    }
    batch = prompts.assign(tensors=tensors, non_tensors=non_tensors)
    return trim_padding(batch, pad_id)


def assemble_stored(groups: list[GroupMeta], prompt_rows: PromptRows, n: int) -> BatchRef:
    """The training rows of ``groups`` (``n`` responses each, stored by their replicas:
    :mod:`tandem.pipeline.group_blocks`) as one ``BatchRef``: the prompts' columns from ``prompt_rows``
    (without their ``prompt_ids``) and each row's ``uid``, ``finish_reason`` and provenance
    (:mod:`tandem.pipeline.provenance`) inline, the groups'
    references concatenated, and every stored field cropped to the batch's longest prompt and
    response. It materialises to :func:`assemble_batch`'s batch of the same groups (less
    ``prompt_ids``, plus the inline scalars of :func:`tandem.pipeline.stored_rollout.store_rollout`);
    an agent group's episodes add their conversations' columns inline (:func:`episode_columns`).
    No block is read. The blocks are released by whoever ends the step."""
    prompts = prompt_rows.collate([g.index for g in groups]).repeat(n, interleave=True)
    left_out = {"prompt_ids", IMAGES_FIELD}  # the blocks hold the rows' images (tandem.dataplane.images)
    columns = prompts.select([k for k in prompts.keys() if k not in left_out]).assign(
        non_tensors={
            "uid": [g.uid for g in groups for _ in range(n)],
            "finish_reason": [reason for g in groups for reason in g.finish_reasons],
            **provenance_columns(groups),
            **episode_columns(groups),
        }
    )
    rows = BatchRef.concat([g.ref for g in groups])  # type: ignore[misc]
    return trim_stored(BatchRef(columns, (), {}).union(rows))


def episode_columns(groups: list[GroupMeta]) -> dict[str, list]:
    """The per-row columns of agent groups' episodes (their metadata, not their tokens):
    ``agent_messages``, ``agent_turns``, ``agent_tool_calls``, ``agent_tool_errors``,
    ``agent_reward`` and, for an agent program's, ``agent_program_splits`` / ``_metrics`` / ``_log``;
    empty for groups of single requests."""
    if not groups or not groups[0].episodes:
        return {}
    episodes = [e for g in groups for e in g.episodes]
    columns: dict[str, list] = {
        "agent_messages": [e.messages for e in episodes],
        "agent_turns": [e.turns for e in episodes],
        "agent_tool_calls": [e.tool_calls for e in episodes],
        "agent_tool_errors": [e.tool_errors for e in episodes],
        "agent_reward": [e.reward for e in episodes],
    }
    if episodes[0].program_log is not None:  # an agent program's episodes
        columns.update(
            agent_program_splits=[e.program_splits for e in episodes],
            agent_program_metrics=[e.program_metrics for e in episodes],
            agent_program_log=[e.program_log for e in episodes],
        )
    return columns
