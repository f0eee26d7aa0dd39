"""Loss aggregation: loop reference, and invariance to micro-batching and data-parallel splits."""

import pytest
import torch

from tandem.algos import (
    LOSS_AGG_MODES,
    LossNormalizer,
    PolicyLossConfig,
    PolicyLossInput,
    aggregate_loss,
    compute_policy_loss,
)
from tests.algos import reference as ref
from tests.algos.test_policy_losses import make_inputs


def random_loss(seed, batch=9, length=6):
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = 0
    return loss, (torch.arange(length) < lengths.unsqueeze(1)).long()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop_reference(mode, seed):
    loss, mask = random_loss(seed)
    terms = {(i, t): loss[i, t] for i in range(mask.shape[0]) for t in ref.valid_positions(mask[i])}
    torch.testing.assert_close(
        aggregate_loss(loss, mask, mode, norm_length=11), ref.aggregate(terms, mask, mode, 11)
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("splits", [[9], [1, 8], [3, 3, 3], [2, 4, 1, 2], [1] * 9])
def test_micro_batch_shares_sum_to_the_full_batch_loss(mode, splits):
    loss, mask = random_loss(3)
    full = aggregate_loss(loss, mask, mode)
    global_counts = LossNormalizer.from_mask(mask)
    shares = [
        aggregate_loss(part_loss, part_mask, mode, global_counts)
        for part_loss, part_mask in zip(loss.split(splits), mask.split(splits), strict=True)
    ]
    torch.testing.assert_close(sum(shares), full)


def test_normalizer_of_parts_adds_up_to_the_global_one():
    _, mask = random_loss(4)
    parts = [LossNormalizer.from_mask(m) for m in mask.split([2, 5, 2])]
    assert parts[0] + parts[1] + parts[2] == LossNormalizer.from_mask(mask)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["ppo", "gspo", "gmpo", "cispo", "sapo"])
def test_gradients_are_invariant_to_data_parallel_and_micro_batch_splits(mode, name):
    """Two 'ranks', each accumulating two micro-batches: summed gradients equal the full batch's."""
    log_probs, old, adv, mask = make_inputs(5, batch=8, length=6)
    cfg = PolicyLossConfig(name=name, loss_agg_mode=mode)
    full = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask), cfg).loss
    (full_grad,) = torch.autograd.grad(full, log_probs)

    counts = LossNormalizer.from_mask(mask)
    accumulated = torch.zeros_like(log_probs)
    for rank_rows in (torch.arange(0, 4), torch.arange(4, 8)):  # data-parallel split
        for micro_rows in rank_rows.split([1, 3]):  # micro-batches on each rank
            inputs = PolicyLossInput(
                log_probs[micro_rows], old[micro_rows], adv[micro_rows], mask[micro_rows], normalizer=counts
            )
            (grad,) = torch.autograd.grad(compute_policy_loss(inputs, cfg).loss, log_probs)
            accumulated += grad
    torch.testing.assert_close(accumulated, full_grad)


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")
