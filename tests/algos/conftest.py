"""Random inputs with the edge cases every estimator and loss must survive."""

import pytest
import torch


def make_rollout(seed: int, batch: int = 12, length: int = 7, dtype=torch.float64):
    """Groups of varied size (including a group of one and an all-equal group) and empty responses.

    Returns ``(rewards [B, R], mask [B, R], group_ids [B])`` with outcome rewards on the last valid token.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[1] = 0  # an empty response
    lengths[2] = length  # a full-length one
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).long()
    # group sizes 4, 3, 1, 4 with shuffled, non-contiguous ids
    group_ids = torch.tensor([7, 7, 7, 7, 3, 3, 3, 42, 5, 5, 5, 5])[:batch]
    perm = torch.randperm(batch, generator=gen)
    group_ids, mask = group_ids[perm], mask[perm]
    scores = torch.randint(0, 3, (batch,), generator=gen).to(dtype)
    scores[group_ids == 5] = 1.0  # a group whose rewards are all equal
    rewards = torch.zeros(batch, length, dtype=dtype)
    for i in range(batch):
        last = int(mask[i].sum()) - 1
        if last >= 0:
            rewards[i, last] = scores[i]
    return rewards, mask, group_ids


@pytest.fixture(params=[0, 1, 2])
def rollout(request):
    return make_rollout(request.param)
