"""A rollout replica's finished prompt groups put into its data-plane store, as training rows.

With ``dataplane.enabled`` in the asynchronous modes (:func:`tandem.rl.step_data.rollout_stays_in_store`)
a replica's :class:`~tandem.pipeline.groups.GroupTracker` stores each finished group with a
:class:`GroupBlockWriter` instead of a sample file: the group's ``n`` rows are built on the
replica, exactly as :func:`tandem.pipeline.runner.assemble_batch` builds them on the controller
(:func:`tandem.protocol.sequences.sequence_tensors`), padded to the run's fixed widths (the
dataset's longest prompt on the left, ``sampling.max_tokens`` on the right) so that every group's
block has one schema, and put as one block by
:func:`~tandem.pipeline.stored_rollout.store_rollout` (the ``[n, ...]`` fields jagged and narrow,
the per-row scalars inline, plus each row's oldest and newest trained weight version). The
controller's :func:`tandem.pipeline.runner.assemble_stored` then concatenates the groups'
references and crops them to the batch's widths; no token reaches it.

An agent group (``agent.*``) is stored the same way: each episode's row has its own prompt (rendered
with the tools' schemas), ``response_mask`` 0 on the tool and user turns, weight version -1 there,
and a split episode's ``position_ids`` restart where each later segment starts
(:mod:`tandem.agents.segments`); the conversations stay in the group's metadata
(:func:`tandem.pipeline.assemble.episode_columns`), and no ``response_text`` is stored (an episode
is scored on its messages). The rows' prompt width is then at least ``data.max_prompt_length``
(:func:`tandem.rl.batch_source.stored_prompt_width`). One difference from the controller's batch:
where a draw mixes split and unsplit episodes, the controller zeroes every row's positions on the
padding, the block only a split episode's (no padding column is attended).

A vision-language model's group (the writer's ``images`` layout) stores the request's images in
each of its rows as tensor columns (:mod:`tandem.dataplane.images`; the tracker packs them beside
the prompt), text-only groups empty ones, so every block keeps one schema; the controller's rows
then hold no image object (``assemble_stored`` leaves the collated ``images`` out).

The queue's byte bound counts a block's file (:meth:`GroupBlockWriter.size_of` is exact: it
encodes the rows as the store will).
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.agents.segments import segment_starts, with_segment_positions
from tandem.dataplane import BatchRef, DataPlaneConfig, store_for
from tandem.dataplane.columns import encode
from tandem.dataplane.images import IMAGE_GRIDS, IMAGE_PIXELS, ImageLayout, image_columns
from tandem.dataplane.shm import PAGE, ShmStore
from tandem.pipeline.stored_rollout import NEWEST_VERSION, OLDEST_VERSION, store_rollout, version_span
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.images import IMAGES_FIELD, ImageInputs
from tandem.protocol.sequences import resize_columns, sequence_tensors

PROMPT_FIELD = "prompt_ids"  # the group's prompt [P] int64, packed with its responses for this writer
# an agent group's [n] int64: each episode's prompt length (its prompts end to end in PROMPT_FIELD)
EPISODE_PROMPT_LENGTHS = "prompt_lengths"


class GroupBlockWriter:
    """Stores packed groups (:meth:`GroupTracker._pack` with the prompt) as data-plane blocks of
    ``[n, ...]`` training rows. ``shm``: files the trainer's ranks or the controller delete, on
    this host. ``ray``: objects in this node's part of Ray's object store, for trainers on any
    node; the writer's store lets go of each block as soon as it is put, so a block lives exactly
    as long as a reference to it does (the group's metadata here until reported, then the
    controller's queue and step and the ranks that read it), and Ray frees it after the step
    that trained on it, or when a stale group is dropped."""

    needs_prompt = True  # the tracker packs the group's prompt ids too

    def __init__(
        self,
        config: DataPlaneConfig,
        prompt_width: int,
        response_width: int,
        pad_id: int,
        tokenizer: Any,
        images: ImageLayout | None = None,
    ) -> None:
        self.store = store_for(config)
        self.images = images  # a vision-language model's: every block stores image columns of this layout
        self.hands_over = config.engine == "ray"  # the references own a Ray block, not the store
        self.prompt_width = prompt_width
        self.response_width = response_width
        self.pad_id = pad_id
        self.tokenizer = tokenizer

    def rows(self, tensors: dict[str, torch.Tensor]) -> Batch:
        """The group's rows at the fixed widths, with their version spans (``[n]``, inline). An
        agent group's rows (:data:`EPISODE_PROMPT_LENGTHS` packed) each have their episode's own
        prompt, ``response_mask`` 1 on the model's tokens only and ``position_ids`` restarting
        where a split episode's later segments start, as :func:`tandem.pipeline.assemble.assemble_batch`
        builds them."""
        bounds = spans_of(tensors["lengths"])
        episodes = EPISODE_PROMPT_LENGTHS in tensors
        if episodes:
            pieces = tensors[PROMPT_FIELD].split(tensors[EPISODE_PROMPT_LENGTHS].tolist())
            prompts = [piece.tolist() for piece in pieces]
        else:
            prompts = [tensors[PROMPT_FIELD].tolist()] * len(bounds)
        longest = max(len(p) for p in prompts)
        if longest > self.prompt_width:
            raise ValueError(
                f"a prompt of {longest} tokens (an agent's with the tools' schemas) is wider than the "
                f"run's {self.prompt_width}: raise data.max_prompt_length or offer fewer tools"
            )
        routed = spans_of(tensors["routed_lengths"]) if "routed_lengths" in tensors else None
        completions = [
            Completion(
                str(i),
                (),
                tensors["token_ids"][start:end],  # type: ignore[arg-type]
                tensors["log_probs"][start:end],  # type: ignore[arg-type]
                tensors["versions"][start:end],  # type: ignore[arg-type]
                "",  # the finish reasons travel in the group's metadata
                token_mask=tensors["token_mask"][start:end] if episodes else None,  # type: ignore[arg-type]
                routed_experts=tensors["routed_experts"][slice(*routed[i])] if routed else None,
            )
            for i, (start, end) in enumerate(bounds)
        ]
        starts = [segment_starts(tensors, start, end) for start, end in bounds] if episodes else []
        fields = resize_columns(
            sequence_tensors(prompts, completions, self.pad_id),
            self.prompt_width,
            self.response_width,
            self.pad_id,
        )
        fields = with_segment_positions(fields, starts) if any(starts) else with_plain_positions(fields)
        oldest, newest = version_span(fields["weight_version"], fields["response_mask"])
        rows = Batch(fields).assign(tensors={OLDEST_VERSION: oldest, NEWEST_VERSION: newest})
        if self.images is None:
            return rows
        image = ImageInputs(tensors[IMAGE_PIXELS], tensors[IMAGE_GRIDS]) if IMAGE_PIXELS in tensors else None
        return rows.assign(non_tensors={IMAGES_FIELD: [image] * len(bounds)})  # the group's, each row

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> BatchRef:
        """Put the group's rows as one block; returns its reference (``key`` names nothing here)."""
        # an agent episode is scored on its messages (the controller's metadata): no decoded text
        return self.put_rows(self.rows(tensors), decode=EPISODE_PROMPT_LENGTHS not in tensors)

    def put_rows(self, rows: Batch, decode: bool = True) -> BatchRef:
        """Put generated ``rows`` (:func:`~tandem.pipeline.stored_rollout.store_rollout`'s input, at
        the writer's widths; ``decode``: with their ``response_text``) as one block: a group's, or
        ReMax's greedy responses
        (:meth:`tandem.pipeline.replica_worker.RolloutReplicaWorker.generate_to_store`)."""
        ref = store_rollout(rows, self.store, self.tokenizer, decode, self.images)
        if self.hands_over:
            ref.release(self.store.release)
        return ref

    def size_of(self, tensors: dict[str, torch.Tensor]) -> int:
        """The bytes of the block :meth:`write` would put (the shm engine's file: each encoded
        array on whole pages)."""
        rows = self.rows(tensors)
        stored = {k: t for k, t in rows.tensors.items() if t.ndim >= 2}
        if self.images is not None:
            stored.update(image_columns(rows[IMAGES_FIELD], self.images)[0])
        _, arrays = encode(stored)
        return sum(-(-a.numel() * a.element_size() // PAGE) * PAGE for a in arrays.values())

    def discard_all(self) -> None:
        """Delete the blocks this process's store put that are still there (shutdown; a Ray block
        goes with its last reference)."""
        if isinstance(self.store, ShmStore):
            self.store.discard_all()


def with_plain_positions(fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``fields`` with ``position_ids [B, P+R]`` counted over the whole (resized) ``attention_mask``,
    held at the last position on the right padding, as ``sequence_tensors`` writes them: the form
    the store derives instead of storing (:mod:`tandem.dataplane.derived`), and that a crop to the
    batch's widths leaves equal to the controller's batch. (``resize_columns`` pads them with 0.)"""
    positions = (fields["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return {**fields, "position_ids": positions}


def spans_of(lengths: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each of the consecutive pieces of ``lengths``."""
    ends = lengths.cumsum(0).tolist()
    return list(zip([0, *ends[:-1]], ends, strict=True))
