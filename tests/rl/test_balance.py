"""Balanced rank order against the plain chunking it replaces: same rows, groups kept, tokens evened out."""

import itertools

import torch

from tandem.rl.balance import balanced_rank_order


def _mask(lengths: list[int], width: int = 64) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)).long()


def _rank_tokens(lengths: list[int], order: list[int], world: int) -> list[int]:
    per_rank = len(order) // world
    return [sum(lengths[i] for i in order[r * per_rank : (r + 1) * per_rank]) for r in range(world)]


def test_groups_move_together_and_ranks_get_nearly_equal_tokens():
    # 8 groups of 4 responses; the long-tail groups come first, so plain chunking overloads rank 0.
    lengths = [60, 58, 61, 59] * 2 + [5, 6, 4, 5] * 6
    order = balanced_rank_order(_mask(lengths), group_size=4, world_size=2)
    assert sorted(order) == list(range(len(lengths)))
    for start in range(0, len(order), 4):  # each slot of 4 is one whole group, in order
        group = order[start : start + 4]
        assert group[0] % 4 == 0 and group == list(range(group[0], group[0] + 4))
    plain = _rank_tokens(lengths, list(range(len(lengths))), 2)
    balanced = _rank_tokens(lengths, order, 2)
    assert max(balanced) - min(balanced) < (max(plain) - min(plain)) / 4
    assert sum(balanced) == sum(plain)


def test_rows_move_alone_when_groups_do_not_divide_over_the_ranks():
    lengths = [50, 49, 3, 2, 48, 4]  # 3 groups of 2 over 2 ranks
    order = balanced_rank_order(_mask(lengths), group_size=2, world_size=2)
    assert sorted(order) == list(range(6))
    total = sum(lengths)
    best = min(  # brute force over every equal split of the rows
        abs(total - 2 * sum(lengths[i] for i in half)) for half in itertools.combinations(range(6), 3)
    )
    tokens = _rank_tokens(lengths, order, 2)
    assert abs(tokens[0] - tokens[1]) == best
