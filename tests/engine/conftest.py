"""Shared fixtures: a tiny model saved to disk, and random padded batches."""

import pytest
import torch

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.protocol import Batch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", TinyModelConfig(family="qwen2")))


def random_batch(
    seed: int, batch: int = 8, length: int = 24, vocab: int = 103, left_pad_rows: int = 2
) -> Batch:
    """Right-padded rows of random lengths (a few left-padded), with a loss mask over each row's second half."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, length + 1, (batch,), generator=gen)
    lengths[0] = length
    mask = (torch.arange(length) < lengths[:, None]).long()
    for row in range(1, 1 + left_pad_rows):
        mask[row] = mask[row].flip(0)
    ids = torch.randint(6, vocab, (batch, length), generator=gen) * mask
    loss_mask = mask.clone()
    loss_mask[:, : length // 3] = 0
    return Batch({"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask})
