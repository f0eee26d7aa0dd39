"""Batches the data-plane tests store: today's padded layout, with real padding."""

from collections import Counter

import pytest
import torch

from tandem.dataplane.columns import encode, read_columns
from tandem.protocol import Batch

PAD = 0


def padded_batch(rows: int = 7, prompt: int = 5, response: int = 6, seed: int = 0) -> Batch:
    """A batch in the layout the RL stages pass today: left-padded prompts, right-padded responses,
    int64 token ids and masks, fp32 log-probs, int64 versions, per-row scalars and a Python column."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt + 1, (rows,), generator=gen)
    response_lens = torch.randint(0, response + 1, (rows,), generator=gen)
    prompts = torch.full((rows, prompt), PAD, dtype=torch.int64)
    responses = torch.full((rows, response), PAD, dtype=torch.int64)
    for i in range(rows):
        prompts[i, prompt - prompt_lens[i] :] = torch.randint(1, 49152, (int(prompt_lens[i]),), generator=gen)
        responses[i, : response_lens[i]] = torch.randint(1, 49152, (int(response_lens[i]),), generator=gen)
    responses[0, : response_lens[0]] = PAD  # a pad-valued token (eos = pad) inside a response
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = torch.cat(
        [
            torch.arange(prompt) >= prompt - prompt_lens[:, None],
            torch.arange(response) < response_lens[:, None],
        ],
        dim=1,
    ).long()
    response_mask = attention_mask[:, prompt:].clone()
    log_probs = -torch.rand(rows, response, generator=gen) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "response_mask": response_mask,
            "rollout_log_probs": log_probs,
            "weight_version": torch.full((rows, response), 3, dtype=torch.int64) * response_mask,
            "group_ids": torch.arange(rows) // 2,
            "token_level_scores": log_probs.neg(),
        },
        {"uid": [f"g{i // 2}" for i in range(rows)], "data_source": ["math"] * rows},
        meta={"weight_version": 3},
    )


@pytest.fixture
def batch() -> Batch:
    return padded_batch()


def block_fields(batch: Batch) -> dict[str, torch.Tensor]:
    """The fields ``BatchRef.put`` stores as one block: every tensor field of rank >= 2."""
    return {name: t for name, t in batch.tensors.items() if t.ndim >= 2}


def stored_bytes_by_field(block: dict[str, torch.Tensor], fields, rows) -> Counter:
    """Payload bytes, by the stored field they are read from, of a fetch of ``rows`` of ``fields``
    from a block of ``block``'s tensors once encoded (each row counted once): an asked field's
    values, a derived one's sources' (``read_columns``), nothing of a field stored as windows alone."""
    columns, arrays = encode(block)
    total = Counter()
    for column in read_columns(columns, list(fields)):
        name = column.name
        if column.constant_bits is not None:
            continue
        values = arrays[f"{name}.values"]
        item = values[0].numel() * values.element_size() if values.numel() else 0
        if column.jagged:
            offsets = arrays[f"{name}.offsets"].numpy()
            total[name] += sum(int(offsets[r + 1] - offsets[r]) for r in set(rows)) * item
        else:
            total[name] += len(set(rows)) * item
    return +total


def stored_nbytes(batch, fields, rows) -> int:
    """Payload bytes of ``rows`` of ``fields`` of ``batch`` put as one block, once encoded."""
    return sum(stored_bytes_by_field(block_fields(batch), fields, rows).values())


def stored_index_bytes(batch, fields, rows) -> int:
    """The 8 bytes a row (an int32 length and start) of each jagged field such a fetch reads."""
    columns, _ = encode(block_fields(batch))
    return 8 * len(list(rows)) * sum(c.jagged for c in read_columns(columns, list(fields)))
