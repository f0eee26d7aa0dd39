"""The seed recipe: every seed of a run (sampling, mini-batch shuffling, data order) comes from the
run's seed and integers that say what it is for, so runs are reproducible and streams distinct."""

from __future__ import annotations

SEED_MODULUS = 2**61 - 1  # a Mersenne prime: seeds stay below 2**61, inside int64


def derive_seed(*parts: int) -> int:
    """A seed from integers (run seed, then what it is for: step, round, row, ...): distinct and reproducible."""
    value = 0
    for part in parts:
        value = (value * 1_000_003 + int(part)) % SEED_MODULUS
    return value
