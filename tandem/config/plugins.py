"""User plugins: Python files whose ``@register_*`` calls add names to tandem's registries.

A plugin is named by the ``plugins`` key of a command's config (``plugins=[my_algos.py]``) or by
``--plugin FILE`` on the command line. The config loaders import it before the config is
validated, so the names it registers validate like built-in ones, and every worker process a
worker group starts imports it again before its worker is built (the group passes this
process's plugins on in :data:`PLUGINS_ENV`, as it passes ``RANK``), so workers find the names
too. A file is imported once per process, however often it is named, under a module name made
from its absolute path (kept in ``sys.modules``: what it defines pickles by reference between
processes that loaded it).

A broken plugin is one error that names the file and the reason, raised before any model loads:
a missing file (``FileNotFoundError: plugins='x.py' is not a file``), a syntax error, an
exception while it runs, or a name already registered (``plugins='x.py': line 7: ValueError:
advantage estimator 'grpo' is already registered (by 'compute_grpo_advantage')``). Names the
file registered before the failing line stay registered; the command stops there anyway.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from tandem.config.user_code import load_user_module

PLUGINS_ENV = "TANDEM_PLUGINS"  # os.pathsep-joined absolute paths a worker process imports first
_LOADED: dict[str, str] = {}  # absolute path -> its module's name, in the order they loaded


def load_plugins(paths: Sequence[str], field: str = "plugins") -> None:
    """Import each plugin file of ``paths`` (named by ``field`` in errors: ``plugins``,
    ``--plugin``) that this process has not imported yet, in order."""
    for path in paths:
        file = str(Path(path).resolve())
        if file in _LOADED:
            continue
        name = _module_name(file)
        load_user_module(path, field, module_name=name)
        _LOADED[file] = name


def _module_name(file: str) -> str:
    """``tandem_plugin_<stem>_<8 hex digits of the path>``: the same in every process that
    imports ``file``, and distinct for two files of one name."""
    stem = re.sub(r"\W", "_", Path(file).stem)
    return f"tandem_plugin_{stem}_{hashlib.sha256(file.encode()).hexdigest()[:8]}"


def loaded_plugins() -> tuple[str, ...]:
    """The absolute paths of the plugin files this process imported, in order."""
    return tuple(_LOADED)


def plugins_env() -> dict[str, str]:
    """The environment a worker group gives its worker processes so they import this process's
    plugins (:func:`load_plugins_from_env`); empty when there are none."""
    return {PLUGINS_ENV: os.pathsep.join(_LOADED)} if _LOADED else {}


def load_plugins_from_env() -> None:
    """Import the plugins the worker group named in :data:`PLUGINS_ENV` (none when it is unset)."""
    named = os.environ.get(PLUGINS_ENV, "")
    if named:
        load_plugins(named.split(os.pathsep), PLUGINS_ENV)


def plugin_of(fn: Callable) -> str | None:
    """The plugin file that defined ``fn``, or None for a function of tandem's own (or of any
    other module)."""
    module = getattr(fn, "__module__", None)
    return next((file for file, name in _LOADED.items() if name == module), None)
