"""Batches the data-plane tests store: today's padded layout, with real padding."""

import pytest
import torch

from tandem.dataplane.columns import encode_field
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


def stored_nbytes(batch, fields, rows) -> int:
    """Payload bytes of ``rows`` of ``fields`` once encoded (each row's values, counted once)."""
    total = 0
    for name in fields:
        column, arrays = encode_field(name, batch[name])
        values = arrays[f"{name}.values"]
        item = values[0].numel() * values.element_size() if values.numel() else 0
        if column.jagged:
            offsets = arrays[f"{name}.offsets"].numpy()
            total += sum(int(offsets[r + 1] - offsets[r]) for r in set(rows)) * item
        else:
            total += len(set(rows)) * item
    return total
