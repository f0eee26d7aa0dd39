"""Turning prompts and completions into the padded tensors of the data protocol, and back.

Layout (``P`` = the batch's longest prompt, ``R`` = its longest response):
``prompts [B, P]`` left-padded, ``responses [B, R]`` right-padded, ``input_ids = cat(prompts,
responses) [B, P+R]`` with its ``attention_mask`` and ``position_ids``; ``response_mask``,
``rollout_log_probs`` and ``weight_version`` are ``[B, R]``; a mixture-of-experts rollout's
``routed_experts`` is ``[B, P+R, L, k]``, aligned with ``input_ids`` (-1 on padding).

``response_mask`` marks the tokens the policy sampled, the ones its loss covers. For a
single-turn response it equals the response's attention mask; an agent episode's response also
holds tool results and user replies between the model's turns, attended to but masked out. A
response's length is therefore its attention span (:func:`response_lengths`), and its last
sampled token (:func:`last_sampled_token`) is where a sequence reward goes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.protocol import Batch
from tandem.protocol.generation import Completion

ROUTING_DTYPE = torch.int16  # recorded expert ids of routed_experts: up to 32767 experts, -1: not routed


def _left_pad(rows: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
    return ids, mask


def sequence_tensors(
    prompt_ids: Sequence[Sequence[int]], completions: Sequence[Completion], pad_id: int
) -> dict[str, torch.Tensor]:
    """The protocol's generation fields for ``completions`` of ``prompt_ids`` (see the module docstring).

    A completion's ``token_ids``, ``log_probs`` and ``weight_versions`` may be lists or 1-D
    tensors (views of the sample store, :func:`tandem.pipeline.runner.assemble_batch`).
    """
    width = max(len(p) for p in prompt_ids)
    length = max(1, max(len(c.token_ids) for c in completions))
    prompts, prompt_mask = _left_pad(prompt_ids, width, pad_id)
    batch = len(completions)
    responses = torch.full((batch, length), pad_id, dtype=torch.long)
    response_mask = torch.zeros((batch, length), dtype=torch.long)
    log_probs = torch.zeros((batch, length), dtype=torch.float32)
    versions = torch.zeros((batch, length), dtype=torch.long)
    for i, completion in enumerate(completions):  # fields are lists, or 1-D tensors (copied once)
        n = len(completion.token_ids)
        if n:
            responses[i, :n] = torch.as_tensor(completion.token_ids)
            response_mask[i, :n] = (
                1 if completion.token_mask is None else torch.as_tensor(completion.token_mask)
            )
            log_probs[i, :n] = torch.as_tensor(completion.log_probs, dtype=torch.float32)
            versions[i, :n] = torch.as_tensor(completion.weight_versions)
    spans = (
        torch.arange(length).expand(batch, length)
        < torch.tensor([len(c.token_ids) for c in completions])[:, None]
    )
    attention_mask = torch.cat([prompt_mask, spans.long()], dim=1)
    routing = {}
    if completions and all(c.routed_experts is not None for c in completions):
        lengths = [len(p) for p in prompt_ids]
        routing["routed_experts"] = routed_experts_tensor(completions, lengths, width, length)
    return {
        **routing,
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
        "weight_version": versions,
    }


def routed_experts_tensor(
    completions: Sequence[Completion], prompt_lengths: Sequence[int], prompt_width: int, length: int
) -> torch.Tensor:
    """``[B, P+R, L, k]`` int16: each completion's ``routed_experts`` (its ``prompt_lengths[i]``
    prompt tokens, then its response tokens) placed like its tokens in ``input_ids`` (prompt
    left-padded to ``prompt_width``, response right-padded to ``length``), -1 on padding."""
    first = completions[0].routed_experts
    out = torch.full((len(completions), prompt_width + length, *first.shape[1:]), -1, dtype=ROUTING_DTYPE)
    for i, (completion, prompt) in enumerate(zip(completions, prompt_lengths, strict=True)):
        routed = completion.routed_experts
        out[i, prompt_width - prompt : prompt_width + routed.shape[0] - prompt] = routed
    return out


def response_part(per_token: torch.Tensor, prompt_width: int) -> torch.Tensor:
    """The response columns ``[B, R]`` of a per-token tensor aligned with ``input_ids [B, P+R]``."""
    return per_token[:, prompt_width:]


PROMPT_LENGTH = "prompt_length"  # [B] int64: a row's prompt tokens, held inline where the tokens are stored
RESPONSE_LENGTH = "response_length"  # [B] int64: its response tokens (attention span), likewise


def response_lengths(batch: Batch) -> torch.Tensor:
    """``[B]``: each response's tokens, sampled or not (its attention span); a batch whose token
    fields stay in the data plane holds them as ``response_length``."""
    if RESPONSE_LENGTH in batch:
        return batch[RESPONSE_LENGTH]
    return batch["attention_mask"][:, batch["prompts"].shape[1] :].sum(-1)


def prompt_lengths(batch: Batch) -> torch.Tensor:
    """``[B]``: each row's prompt tokens (``prompt_length`` where the tokens are stored)."""
    if PROMPT_LENGTH in batch:
        return batch[PROMPT_LENGTH]
    return batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1)


def sequence_lengths(batch: Batch) -> torch.Tensor:
    """``[B]``: each row's attended tokens, prompt and response (``attention_mask``'s row sums)."""
    return prompt_lengths(batch) + response_lengths(batch)


def last_sampled_token(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: the column of each response's last sampled token (0 for an empty response)."""
    columns = torch.arange(response_mask.shape[1]).expand_as(response_mask)
    return torch.where(response_mask.bool(), columns, 0).amax(-1)


def decode_responses(tokenizer, responses: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    """The text of each response's first ``lengths`` tokens (special tokens such as EOS dropped)."""
    return [
        tokenizer.decode(row[:n].tolist(), skip_special_tokens=True)
        for row, n in zip(responses, lengths.tolist(), strict=True)
    ]


def decode_sampled(tokenizer, responses: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    """The text of each row's sampled tokens: ``responses [B, R]`` where ``response_mask [B, R]`` is
    set (an agent episode's tool and user turns left out), special tokens dropped."""
    return [
        tokenizer.decode(row[mask.bool()].tolist(), skip_special_tokens=True)
        for row, mask in zip(responses, response_mask, strict=True)
    ]


SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids")
ROUTING_FIELDS = ("routed_experts",)  # [B, S, L, k]: padded along dim 1 like input_ids, with -1
PER_SEQUENCE_2D_FIELDS = ("reward_components",)  # [B, K]: never resized, whatever K is


def resize_columns(
    tensors: dict[str, torch.Tensor], prompt_width: int, response_width: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Pad or cut every generation-layout field to ``prompt_width`` / ``response_width`` columns.

    ``prompts`` grows or shrinks on the left, response-side fields (``[B, R]`` tensors such as
    ``responses``, ``response_mask``, scores and log-probs) on the right, and ``input_ids``-like
    fields on both sides. Other tensors pass through. Only padding may be cut.
    """
    old_prompt, old_response = tensors["prompts"].shape[1], tensors["responses"].shape[1]
    left, right = prompt_width - old_prompt, response_width - old_response

    def fill(name: str) -> int:
        return pad_id if name in ("prompts", "responses", "input_ids") else 0

    out = {}
    for name, tensor in tensors.items():
        if name == "prompts":
            out[name] = torch.nn.functional.pad(tensor, (left, 0), value=fill(name))
        elif name in SEQUENCE_FIELDS:
            out[name] = torch.nn.functional.pad(tensor, (left, right), value=fill(name))
        elif name in ROUTING_FIELDS:  # pad dim 1 of [B, S, L, k]
            out[name] = torch.nn.functional.pad(tensor, (0, 0, 0, 0, left, right), value=-1)
        elif tensor.ndim == 2 and tensor.shape[1] == old_response and name not in PER_SEQUENCE_2D_FIELDS:
            out[name] = torch.nn.functional.pad(tensor, (0, right), value=fill(name))
        else:
            out[name] = tensor
    return out


def trim_padding(batch: Batch, pad_id: int) -> Batch:
    """The batch with prompt columns cut to its longest prompt and response columns to its longest response."""
    prompt_width = int(prompt_lengths(batch).max())
    response_width = max(1, int(response_lengths(batch).max()))
    tensors = resize_columns(dict(batch.tensors.items()), prompt_width, response_width, pad_id)
    return Batch(tensors, batch.non_tensors, batch.meta)


def concat_sequences(batches: Sequence[Batch], pad_id: int) -> Batch:
    """Concatenate generation batches of different widths (each is widened to the widest first)."""
    prompt_width = max(b["prompts"].shape[1] for b in batches)
    response_width = max(b["responses"].shape[1] for b in batches)
    widened = [
        Batch(
            resize_columns(dict(b.tensors.items()), prompt_width, response_width, pad_id),
            b.non_tensors,
            b.meta,
        )
        for b in batches
    ]
    return Batch.concat(widened)
