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

The queue's byte bound counts a block's file (:meth:`GroupBlockWriter.size_of` is exact: it
encodes the rows as the store will).
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.dataplane import BatchRef, DataPlaneConfig, store_for
from tandem.dataplane.columns import encode
from tandem.dataplane.shm import PAGE, ShmStore
from tandem.pipeline.stored_rollout import NEWEST_VERSION, OLDEST_VERSION, store_rollout, version_span
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import resize_columns, sequence_tensors

PROMPT_FIELD = "prompt_ids"  # the group's prompt [P] int64, packed with its responses for this writer


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
        self, config: DataPlaneConfig, prompt_width: int, response_width: int, pad_id: int, tokenizer: Any
    ) -> None:
        self.store = store_for(config)
        self.hands_over = config.engine == "ray"  # the references own a Ray block, not the store
        self.prompt_width = prompt_width
        self.response_width = response_width
        self.pad_id = pad_id
        self.tokenizer = tokenizer

    def rows(self, tensors: dict[str, torch.Tensor]) -> Batch:
        """The group's rows at the fixed widths, with their version spans (``[n]``, inline)."""
        prompt = tensors[PROMPT_FIELD].tolist()
        if len(prompt) > self.prompt_width:
            raise ValueError(f"a prompt of {len(prompt)} tokens is wider than the run's {self.prompt_width}")
        bounds = tensors["lengths"].cumsum(0).tolist()
        routed_bounds = tensors["routed_lengths"].cumsum(0).tolist() if "routed_lengths" in tensors else None
        completions = []
        for i, end in enumerate(bounds):
            start = bounds[i - 1] if i else 0
            routed = None
            if routed_bounds is not None:
                routed = tensors["routed_experts"][(routed_bounds[i - 1] if i else 0) : routed_bounds[i]]
            completions.append(
                Completion(
                    str(i),
                    (),
                    tensors["token_ids"][start:end],  # type: ignore[arg-type]
                    tensors["log_probs"][start:end],  # type: ignore[arg-type]
                    tensors["versions"][start:end],  # type: ignore[arg-type]
                    "",  # the finish reasons travel in the group's metadata
                    routed_experts=routed,
                )
            )
        fields = sequence_tensors([prompt] * len(completions), completions, self.pad_id)
        fields = resize_columns(fields, self.prompt_width, self.response_width, self.pad_id)
        oldest, newest = version_span(fields["weight_version"], fields["response_mask"])
        return Batch(fields).assign(tensors={OLDEST_VERSION: oldest, NEWEST_VERSION: newest})

    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> BatchRef:
        """Put the group's rows as one block; returns its reference (``key`` names nothing here)."""
        return self.put_rows(self.rows(tensors))

    def put_rows(self, rows: Batch) -> BatchRef:
        """Put generated ``rows`` (:func:`~tandem.pipeline.stored_rollout.store_rollout`'s input, at
        the writer's widths) as one block: a group's, or ReMax's greedy responses
        (:meth:`tandem.pipeline.replica_worker.RolloutReplicaWorker.generate_to_store`)."""
        ref = store_rollout(rows, self.store, self.tokenizer)
        if self.hands_over:
            ref.release(self.store.release)
        return ref

    def size_of(self, tensors: dict[str, torch.Tensor]) -> int:
        """The bytes of the block :meth:`write` would put (the shm engine's file: each encoded
        array on whole pages)."""
        rows = self.rows(tensors)
        _, arrays = encode({k: t for k, t in rows.tensors.items() if t.ndim >= 2})
        return sum(-(-a.numel() * a.element_size() // PAGE) * PAGE for a in arrays.values())

    def discard_all(self) -> None:
        """Delete the blocks this process's store put that are still there (shutdown; a Ray block
        goes with its last reference)."""
        if isinstance(self.store, ShmStore):
            self.store.discard_all()
