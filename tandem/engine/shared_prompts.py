"""Packing with shared prompts: rows that carry the same prompt compute it once.

GRPO-style batches hold ``n`` responses per prompt. In a causal model the prompt's hidden
states do not depend on what follows, so the ``n`` copies of a prompt compute the same
thing; with short responses the copies are a large share of the batch (a third of the
tokens for 25-token prompts and 50-token responses). Here each group of rows with equal
prompt tokens is packed as ``[prompt, response_1, ..., response_n]``; response ``i`` keeps
the positions it has in its own row (``len(prompt) ...``) and attends to the one packed
prompt plus its own tokens (see :class:`tandem.engine.varlen_attention.AttentionPlan`). In
backward the gradients of the ``n`` readers of the prompt's keys and values add up, which is
what the ``n`` separate copies would have received in total. Log-probs come out for the
response tokens only (the first one predicted from the prompt's last hidden state); prompt
positions hold 0.

The layout needs the prompt/response boundary: the data protocol's ``prompts [B, P]``
column (left-padded) is the first ``P`` columns of ``input_ids``. A vision-language prompt
is its tokens and its images: rows share a prompt only when both are equal (rows with the
same text but other images hold the same placeholder tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.packing import PackedSequences, Predictions, check_same_shape
from tandem.engine.varlen_attention import plan_sequences
from tandem.engine.vision_inputs import images_key
from tandem.protocol.images import ImageInputs


def prompt_groups(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    images: Sequence[ImageInputs | None] | None = None,
) -> list[list[int]]:
    """Row indices grouped by equal prompt tokens (the valid ones of the first ``prompt_width``
    columns) and equal ``images`` (one entry per row, when given), groups in order of first
    appearance, rows in order within a group."""
    groups: dict[tuple, list[int]] = {}
    prompts = input_ids[:, :prompt_width].tolist()
    masks = attention_mask[:, :prompt_width].bool().tolist()
    for row, (ids, mask) in enumerate(zip(prompts, masks, strict=True)):
        key = tuple(token for token, valid in zip(ids, mask, strict=True) if valid)
        if images is not None:
            key = (key, images_key(images[row]))
        groups.setdefault(key, []).append(row)
    return list(groups.values())


def pack_shared_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_width: int,
    images: Sequence[ImageInputs | None] | None = None,
) -> PackedSequences:
    """Pack ``input_ids [B, S]`` (prompt in columns ``< prompt_width``, then the response) with
    one copy of each distinct prompt (tokens and, when given, ``images``); rows with an empty
    prompt are an error."""
    check_same_shape(input_ids, attention_mask)
    batch, width = input_ids.shape
    mask = attention_mask.bool()
    columns = torch.arange(width)
    tokens, positions, flat, owned_tokens, copied_from = [], [], [], [], []
    sequences, owned, sources, targets = [], [], [], []
    cursor = 0
    for group in prompt_groups(input_ids, attention_mask, prompt_width, images):
        owner = group[0]
        prompt_columns = columns[:prompt_width][mask[owner, :prompt_width]]
        length = len(prompt_columns)
        if length == 0:
            raise ValueError(
                f"row {owner} has an empty prompt; shared-prompt packing needs one token at least"
            )
        prompt = torch.arange(cursor, cursor + length)
        tokens.append(input_ids[owner, prompt_columns])
        copied_from.append(owner * width + prompt_columns)
        positions.append(torch.arange(length))
        cursor += length
        for rank, row in enumerate(group):
            response_columns = columns[prompt_width:][mask[row, prompt_width:]]
            count = len(response_columns)
            response = torch.arange(cursor, cursor + count)
            tokens.append(input_ids[row, response_columns])
            copied_from.append(row * width + response_columns)
            positions.append(torch.arange(length, length + count))
            flat.append(row * width + response_columns)
            owned_tokens.append(response)
            sequences.append(torch.cat([prompt, response]))
            owned.append(torch.cat([torch.full((length,), rank == 0), torch.ones(count, dtype=torch.bool)]))
            sources.append(torch.cat([prompt[-1:], response[:-1]])[:count])
            targets.append(response)
            cursor += count
    return PackedSequences(
        input_ids=torch.cat(tokens).unsqueeze(0),
        position_ids=torch.cat(positions).unsqueeze(0),
        cu_seqlens=None,
        flat_index=torch.cat(flat),
        padded_shape=(batch, width),
        attention_plan=plan_sequences(sequences, owned, cursor),
        token_index=torch.cat(owned_tokens),
        predictions=Predictions(torch.cat(sources), torch.cat(targets)),
        source_index=torch.cat(copied_from),
    )
