"""Loading a user's Python file named in the config (reward functions, tools, interactions).

Errors name the config field and, for a file that fails while loading, the line in the user's
file: ``reward.custom_path='r.py': line 3: ModuleNotFoundError: ...``.
"""

from __future__ import annotations

import importlib.util
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType


def load_user_module(path: str, field: str) -> ModuleType:
    """The Python file at ``path`` (the value of config field ``field``), imported."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{field}={path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"tandem_user_{field.replace('.', '_')}_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{field}={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as error:
        raise ValueError(f"{field}={path!r}: line {error.lineno}: SyntaxError: {error.msg}") from None
    except Exception as error:  # a failing import or top-level statement in the user's file
        lines = [
            frame.lineno
            for frame in traceback.extract_tb(error.__traceback__)
            if Path(frame.filename) == file
        ]
        where = f"line {lines[-1]}" if lines else "while loading"
        raise ValueError(f"{field}={path!r}: {where}: {type(error).__name__}: {error}") from error
    return module


def load_user_function(path: str, name: str, field: str, name_field: str) -> Callable:
    """The function ``name`` (config field ``name_field``) of the file at ``path`` (``field``)."""
    function = getattr(load_user_module(path, field), name, None)
    if not callable(function):
        raise ValueError(f"{field}={path!r} defines no function {name!r} ({name_field})")
    return function
