"""Reward components: named numeric fields of each dict a reward function returns, as a ``[B, K]`` tensor.

GDPO normalises each component on its own (``algorithm.gdpo_reward_keys`` names them). A
component the run asks for must be there: a result without it, or with something other than a
finite number in it, is an error naming the item, the key and the fields the function did
return. Items whose call failed (raised or timed out) are already scored 0 and counted; their
components are 0 too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.config.user_values import describe, real_number
from tandem.rl.rewards.parallel import CallResult

KEYS_SETTING = "algorithm.gdpo_reward_keys"


def reward_components(
    results: Sequence[CallResult], keys: Sequence[str], data_sources: Sequence[str]
) -> torch.Tensor:
    """``[B, len(keys)]`` float32: ``results[i].value[keys[k]]`` for each item ``i`` (see the module docstring)."""
    rows = []
    for index, (result, source) in enumerate(zip(results, data_sources, strict=True)):
        if result.error is not None:
            rows.append([0.0] * len(keys))
            continue
        where = f"reward item {index} ({source})"
        value = result.value
        if not isinstance(value, dict):
            raise ValueError(
                f"{where}: {KEYS_SETTING}={list(keys)} needs the reward function to return a dict with those "
                f"fields, but it returned {describe(value)}"
            )
        row = []
        for key in keys:
            if key not in value:
                raise ValueError(
                    f"{where}: the reward function's result has no field {key!r} ({KEYS_SETTING}); "
                    f"it returned the fields {sorted(map(str, value))}"
                )
            number = real_number(value[key])
            if number is None:
                raise ValueError(
                    f"{where}: field {key!r} ({KEYS_SETTING}) is {describe(value[key])}, not a finite number"
                )
            row.append(number)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(keys))
