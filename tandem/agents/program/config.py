"""The agent program (``agent.program``), the limits of its episodes, and what it returns."""

from __future__ import annotations

import inspect
import os
import shutil
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tandem.agents.sandbox import SandboxLimits
from tandem.config.user_code import load_user_function
from tandem.config.user_values import describe, real_number

DEFAULT_FUNCTION = "run"
ProgramFunction = Callable[[object, dict], Awaitable[object]]


@dataclass(frozen=True)
class ProgramLimits:
    """What one episode may do: seconds of wall clock (``agent.program_timeout_s``), requests
    (``agent.program_max_requests``), tokens sampled over all its requests
    (``agent.program_max_tokens``) and, for a command, bytes written to stdout and to stderr
    each (``agent.program_output_bytes``) and the OS sandbox's limits it runs under
    (``agent.program_sandbox=true``: ``agent.python``'s; None: not sandboxed) with the host paths
    it also sees, read-only (``agent.program_sandbox_mounts``)."""

    timeout_s: float = 600.0
    max_requests: int = 32
    max_tokens: int = 8192
    output_bytes: int = 16384
    sandbox: SandboxLimits | None = None
    mounts: tuple[str, ...] = ()


def check_command(argv: Sequence[object]) -> tuple[str, ...]:
    """``agent.program_command`` checked: a non-empty list of non-empty strings whose first names
    an executable (on ``PATH``, or a path); a ``ValueError`` naming the key otherwise. It is run
    as it is, without a shell, so an argument is never re-split or expanded."""
    if isinstance(argv, str) or not argv:
        raise ValueError(
            f"agent.program_command={argv!r} must be a non-empty list of arguments, "
            "e.g. agent.program_command=[python,agent.py]"
        )
    for i, argument in enumerate(argv):
        if not isinstance(argument, str) or not argument:
            raise ValueError(f"agent.program_command[{i}]={argument!r} must be a non-empty string")
    executable = argv[0]
    if shutil.which(executable) is None:
        where = "is not an executable file" if os.sep in executable else "is not a program on PATH"
        raise ValueError(f"agent.program_command[0]={executable!r} {where}")
    return tuple(argv)


def split_spec(spec: str) -> tuple[str, str]:
    """``file.py[:function]`` -> ``(file.py, function)`` (the function defaults to ``run``)."""
    path, colon, name = spec.rpartition(":")
    if colon and name.isidentifier() and path:
        return path, name
    return spec, DEFAULT_FUNCTION


def load_program(spec: str) -> ProgramFunction:
    """The ``async def run(client, row)`` named by ``agent.program``; a ``ValueError`` naming
    ``agent.program`` for a file that fails to import, a missing function, one that is not
    ``async`` or one that cannot take ``(client, row)``."""
    path, name = split_spec(spec)
    function = load_user_function(path, name, "agent.program", "agent.program's ':function'")
    if not inspect.iscoroutinefunction(function):
        raise ValueError(
            f"agent.program={spec!r}: {name!r} must be an async function: async def {name}(client, row)"
        )
    try:
        inspect.signature(function).bind(None, None)
    except TypeError:
        raise ValueError(f"agent.program={spec!r}: {name!r} must take two arguments (client, row)") from None
    return function


@dataclass(frozen=True)
class ProgramResult:
    """A program's checked return value: its reward and its metrics (name -> finite number)."""

    reward: float
    metrics: dict[str, float] = field(default_factory=dict)


def read_result(value: object) -> ProgramResult:
    """``value`` (a finite number, or ``{"reward": number, "metrics": {name: number}}``) checked;
    ``ValueError`` saying what is wrong otherwise (a NaN reward would poison the loss)."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"reward", "metrics"})
        if unknown:
            raise ValueError(f"returned a dict with keys {unknown}; it takes 'reward' and 'metrics'")
        reward, metrics = value.get("reward"), value.get("metrics") or {}
    else:
        reward, metrics = value, {}
    number = real_number(reward)
    if number is None:
        raise ValueError(f"returned a reward that is {describe(reward)}, not a finite number")
    if not isinstance(metrics, dict):
        raise ValueError(f"returned 'metrics' of type {type(metrics).__name__}, not a dict")
    checked = {}
    for name, metric in metrics.items():
        metric_number = real_number(metric)
        if not isinstance(name, str) or metric_number is None:
            raise ValueError(f"returned metric {name!r} = {describe(metric)}, not a finite number")
        checked[name] = metric_number
    return ProgramResult(number, checked)
