"""Loading a user's Python file named in the config (reward functions, tools, interactions, plugins).

Errors name the config field and, for a file that fails while loading, the line in the user's
file: ``reward.custom_path='r.py': line 3: ModuleNotFoundError: ...``.
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from collections.abc import Callable
from importlib.abc import Loader
from pathlib import Path
from types import ModuleType


def load_user_module(path: str, field: str, module_name: str | None = None) -> ModuleType:
    """The Python file at ``path`` (the value of config field ``field``), imported.

    ``module_name``: the name it is imported under and kept in ``sys.modules``, so that what it
    defines pickles by reference to a process that imports it under the same name (a plugin's);
    without one, a private name that is not kept."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{field}={path!r} is not a file")
    name = module_name or f"tandem_user_{field.replace('.', '_')}_{file.stem}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"{field}={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    if module_name is not None:
        sys.modules[module_name] = module  # before it runs: its dataclasses look their module up
    try:
        _execute(spec.loader, module, file, f"{field}={path!r}")
    except BaseException:
        if module_name is not None:
            sys.modules.pop(module_name, None)
        raise
    return module


def _execute(loader: Loader, module: ModuleType, file: Path, named: str) -> None:
    """Run ``module``'s code; a failure is one ``ValueError`` that starts with ``named`` and gives
    the line of ``file`` it happened on."""
    try:
        loader.exec_module(module)
    except SyntaxError as error:
        raise ValueError(f"{named}: line {error.lineno}: SyntaxError: {error.msg}") from None
    except Exception as error:  # a failing import or top-level statement in the user's file
        lines = [
            frame.lineno
            for frame in traceback.extract_tb(error.__traceback__)
            if Path(frame.filename) == file
        ]
        where = f"line {lines[-1]}" if lines else "while loading"
        raise ValueError(f"{named}: {where}: {type(error).__name__}: {error}") from error


def load_user_function(path: str, name: str, field: str, name_field: str) -> Callable:
    """The function ``name`` (config field ``name_field``) of the file at ``path`` (``field``)."""
    function = getattr(load_user_module(path, field), name, None)
    if not callable(function):
        raise ValueError(f"{field}={path!r} defines no function {name!r} ({name_field})")
    return function
