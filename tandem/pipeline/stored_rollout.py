"""A rollout's outputs kept in the data plane: the generating rank stores its rows' per-token
fields and hands back a :class:`~tandem.dataplane.BatchRef` with the per-row scalars the
controller needs; the controller trims the padding by rewriting the reference.

On the generating rank, :func:`store_rollout` turns the padded generation ``Batch`` (the fields
of :func:`tandem.protocol.sequences.sequence_tensors`, prompts left-padded to ``prompt_width``,
responses right-padded to ``sampling.max_tokens``) into

* one block in the rank's store with every ``[B, ...]`` tensor: ``prompts``, ``responses``,
  ``input_ids``, ``attention_mask``, ``position_ids``, ``response_mask``, ``rollout_log_probs``,
  ``weight_version`` (and ``routed_experts``; a vision-language run's images as ``image_pixels``
  and ``image_grid_thw``, with their ``[B]`` widths inline: :mod:`tandem.dataplane.images`), in the
  jagged narrow wire form;
* inline, per row: the request's columns (``uid``, ``index``, ``data_source``, ``ground_truth``,
  ``extra_info``, ``seed``, ...) but not its ``prompt_ids``, and ``finish_reason``,
  ``prompt_length [B]``, ``response_length [B]``, ``last_sampled [B]`` (the column of the last
  sampled token, where a sequence reward goes) and ``response_text`` (the decoded response: what
  the rewards read; an agent episode's rows are scored on their messages, so they get none).

On the controller, :func:`trim_stored` cuts every stored field to the longest prompt and response
of all ranks' rows, as :func:`tandem.protocol.sequences.trim_padding` cuts a ``Batch``, by cropping
the reference (no payload is read). Draws stored at one width (the training set's longest prompt,
or an agent program's wider one: :func:`tandem.rl.batch_source.stored_prompt_width`;
``sampling.max_tokens``) join with :func:`concat_stored` (DAPO's draws), and :func:`rows_outside`
names the rows whose blocks a selection no longer needs (to release them).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tandem.dataplane import BatchRef, FieldSchema, Store
from tandem.dataplane.images import IMAGE_WIDTHS, ImageLayout, image_columns, image_window
from tandem.protocol import Batch
from tandem.protocol.images import IMAGES_FIELD
from tandem.protocol.sequences import (
    PROMPT_LENGTH,
    RESPONSE_LENGTH,
    ROUTING_FIELDS,
    SEQUENCE_FIELDS,
    decode_responses,
    last_sampled_token,
    prompt_lengths,
    response_lengths,
)

LAST_SAMPLED = "last_sampled"  # [B] int64: the column (of responses [B, R]) of each row's last sampled token
RESPONSE_TEXT = "response_text"  # the decoded response, what the rewards score
OLDEST_VERSION = "oldest_version"  # [B] int64: an asynchronous row's oldest trained token's weight version
NEWEST_VERSION = "newest_version"  # [B] int64: its newest (the staleness metrics read these, inline)


def version_span(versions: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(oldest [B], newest [B])``: the lowest and highest of ``versions [B, R]`` where ``mask
    [B, R]`` is set (the trained tokens); a row with none gets the dtype's maximum and -1."""
    trained = mask.bool()
    oldest = torch.where(trained, versions, torch.iinfo(versions.dtype).max).min(-1).values
    newest = torch.where(trained, versions, -1).max(-1).values
    return oldest, newest


def store_rollout(
    batch: Batch, store: Store, tokenizer: Any, decode: bool = True, images: ImageLayout | None = None
) -> BatchRef:
    """``batch`` (one rank's generated rows) with its per-token fields put into ``store`` and the
    per-row scalars above inline (see the module docstring); ``decode=False``: no ``response_text``
    (a replica's agent episodes, whose conversations the controller holds). ``images``: the
    rows' ``images`` field is stored as tensor columns of that layout (:mod:`tandem.dataplane.images`)."""
    lengths = response_lengths(batch)
    scalars: dict[str, Any] = {
        PROMPT_LENGTH: prompt_lengths(batch),
        RESPONSE_LENGTH: lengths,
        LAST_SAMPLED: last_sampled_token(batch["response_mask"]),
    }
    texts = {}
    if decode and "agent_messages" not in batch:
        texts[RESPONSE_TEXT] = decode_responses(tokenizer, batch["responses"], lengths)
    stored_images: dict[str, Any] = {}
    if images is not None and IMAGES_FIELD in batch:
        stored_images, widths = image_columns(batch[IMAGES_FIELD], images)
        scalars.update(widths)
    dropped = {"prompt_ids", IMAGES_FIELD} if images is not None else {"prompt_ids"}  # (images: stored)
    rows = batch.select([k for k in batch.keys() if k not in dropped])
    return BatchRef.put(rows.assign(tensors=scalars, non_tensors=texts), store, also=stored_images)


def trim_stored(ref: BatchRef) -> BatchRef:
    """``ref`` with its stored fields cropped to its longest prompt and longest response (at
    least one column), the widths :func:`tandem.protocol.sequences.trim_padding` leaves."""
    prompt_width = ref.schema["prompts"].shape[0]
    response_width = ref.schema["responses"].shape[0]
    keep_prompt = int(ref[PROMPT_LENGTH].max())
    keep_response = max(1, int(ref[RESPONSE_LENGTH].max()))
    left = prompt_width - keep_prompt
    windows: dict[str, tuple[int, int, int]] = {}
    for name, schema in ref.schema.items():
        if name == "prompts":
            windows[name] = (0, left, prompt_width)
        elif name in SEQUENCE_FIELDS:  # [B, P+R] (or [B, 3, P+R]): cut along the last axis
            windows[name] = (len(schema.shape) - 1, left, prompt_width + keep_response)
        elif name in ROUTING_FIELDS:  # [B, P+R, L, k]
            windows[name] = (0, left, prompt_width + keep_response)
        elif name in IMAGE_WIDTHS:  # [B, P, D] / [B, I, 3]: the rows' most patches / images
            windows[name] = image_window(name, ref)
        elif len(schema.shape) == 1 and schema.shape[0] == response_width:  # [B, R] response fields
            windows[name] = (0, 0, keep_response)
    return ref.crop(windows)


def concat_stored(refs: list[BatchRef]) -> BatchRef:
    """The rows of ``refs`` (draws trimmed by :func:`trim_stored`, each to its own widths) in order,
    uncropped to the widths they were stored at; crop the result with :func:`trim_stored`, as
    :func:`tandem.protocol.sequences.concat_sequences` widens and ``trim_padding`` cuts ``Batch`` es.
    ``ValueError`` when the draws were stored at different widths (no crop can join them)."""
    schema: dict[str, FieldSchema] = {}  # each stored field as its blocks hold it (no crop)
    for ref in refs:
        for part in ref.parts:
            for column in (c for block in part.blocks for c in block.columns if c.name in part.fields):
                stored = FieldSchema(column.dtype, tuple(column.shape))
                if schema.setdefault(column.name, stored) != stored:
                    raise ValueError(
                        f"stored draws of different widths cannot be joined: {column.name!r} is "
                        f"{schema[column.name].shape} in one block and {stored.shape} in another"
                    )
    return BatchRef.concat([BatchRef(ref.scalars, ref.parts, schema) for ref in refs])


def rows_outside(ref: BatchRef, kept: BatchRef) -> BatchRef:
    """The rows of ``ref`` none of whose blocks hold a row of ``kept``: releasing their blocks
    (``release_refs``) frees what ``kept`` no longer needs, and nothing it does."""
    used = {id(block) for block in kept.blocks()}
    outside = np.ones(len(ref), dtype=bool)
    for part in ref.parts:
        in_used = np.array([id(block) in used for block in part.blocks], dtype=bool)
        outside &= ~in_used[part.block_of_row]
    return ref[torch.from_numpy(np.flatnonzero(outside))]
