"""Loading a user's reward function from a Python file named in the config."""

from __future__ import annotations

from collections.abc import Callable

from tandem.config.user_code import load_user_function


def load_reward_function(path: str, name: str) -> Callable:
    """``name`` from the Python file ``path``: ``fn(data_source, solution_str, ground_truth, extra_info)``.

    The function returns a float, or a dict with a ``score`` key and further numbers to log.
    """
    return load_user_function(path, name, "reward.custom_path", "reward.custom_name")
