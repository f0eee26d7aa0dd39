"""Loading a user's reward function from a Python file named in the config."""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from pathlib import Path


def load_reward_function(path: str, name: str) -> Callable:
    """``name`` from the Python file ``path``: ``fn(data_source, solution_str, ground_truth, extra_info)``.

    The function returns a float, or a dict with a ``score`` key and further numbers to log.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"reward.custom_path={path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"tandem_user_reward_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward.custom_path={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ValueError(
            f"reward.custom_path={path!r}: line {error.lineno}: SyntaxError: {error.msg}"
        ) from None
    except Exception as error:  # a failing import or top-level statement in the user's file
        lines = [
            frame.lineno
            for frame in traceback.extract_tb(error.__traceback__)
            if Path(frame.filename) == file
        ]
        where = f"line {lines[-1]}" if lines else "while loading"
        raise ValueError(f"reward.custom_path={path!r}: {where}: {type(error).__name__}: {error}") from error
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward.custom_path={path!r} defines no function {name!r} (reward.custom_name)")
    return fn
