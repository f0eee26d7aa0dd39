"""A command-line agent program (``agent.program_command``): one subprocess per episode.

The command runs as it is written (an argument list, no shell), in the run's working directory,
in a process group of its own, with the run's environment plus ``OPENAI_BASE_URL`` (the
endpoint's ``/v1``) and ``OPENAI_API_KEY`` (the episode's key), which is what the ``openai``
clients of every language read. The row (``{"messages", "extra_info", "seed"}``) is JSON on its
stdin, then stdin is closed. Its **result** is the last non-empty line of its stdout: a number
(``0.5``) or a JSON object (``{"reward": 0.5, "metrics": {"turns": 2}}``).

What ends it as a fault, reward 0 (:attr:`CommandRun.problem`): an exit status other than 0
(or a signal), no result line or one that is neither form, more than ``output_bytes`` written
to stdout or to stderr (the process group is killed at the first byte over), and the wall clock
(``timeout_s``: the process group is killed). Whatever it wrote, up to ``output_bytes`` of
each stream, is kept (:attr:`CommandRun.stdout`, :attr:`CommandRun.stderr`). When the command
exits, whatever it left running in its process group is killed too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.agents.program.config import ProgramLimits
from tandem.agents.program.sandboxed import SandboxLaunch, sandboxed, setup_problem

DRAIN_S = 1.0  # after the command exits: how long its pipes may stay open (a child escaped its group)
READ_CHUNK = 65536


@dataclass
class CommandRun:
    """How one episode's command ended: its result's raw value (None on a fault), the fault
    (empty: none), and the output kept (decoded as UTF-8, undecodable bytes replaced)."""

    value: object
    problem: str
    stdout: str
    stderr: str


class _Overflow(Exception):
    """A stream went past its cap (the stream's name)."""


def result_value(stdout: str) -> object:
    """The raw result on the last non-empty line of ``stdout``: a JSON value (a number or an
    object; :func:`~tandem.agents.program.config.read_result` checks it), or a bare number such
    as ``nan`` that JSON does not spell (refused there as not finite). ``ValueError`` saying
    what was printed otherwise."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        raise ValueError("printed no result: its last line of stdout must be a number or a JSON object")
    last = lines[-1]
    try:
        return json.loads(last)
    except ValueError:
        pass
    try:
        return float(last)
    except ValueError:
        shown = last if len(last) <= 80 else last[:77] + "..."
        raise ValueError(
            f"printed {shown!r} as its last line of stdout: not a number nor a JSON object "
            '{"reward": ..., "metrics": {...}}'
        ) from None


async def run_command(
    argv: Sequence[str], row: dict, base_url: str, api_key: str, limits: ProgramLimits
) -> CommandRun:
    """Run ``argv`` for one episode (see the module docstring), in the OS sandbox when
    ``limits.sandbox`` is set (:mod:`~tandem.agents.program.sandboxed`)."""
    if limits.sandbox is None:
        environment = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        return await _run(argv, environment, row, limits, None)
    async with sandboxed(argv, base_url, api_key, limits.sandbox, limits.timeout_s, limits.mounts) as launch:
        return await _run(launch.argv, launch.environment, row, limits, launch)


async def _run(
    argv: Sequence[str], environment: dict[str, str], row: dict, limits: ProgramLimits,
    launch: SandboxLaunch | None,
) -> CommandRun:  # fmt: skip
    """:func:`run_command`'s work: start, feed, watch and end the subprocess."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=environment, start_new_session=True,
            pass_fds=(launch.go_read,) if launch else (),
        )  # fmt: skip
    except OSError as error:
        return CommandRun(None, f"could not start: {error}", "", "")
    streams = {"stdout": bytearray(), "stderr": bytearray()}
    readers = [
        asyncio.ensure_future(_read_capped(pipe, streams[name], name, limits.output_bytes))
        for name, pipe in (("stdout", process.stdout), ("stderr", process.stderr))
    ]
    feeder = asyncio.ensure_future(_feed(process, json.dumps(row).encode()))
    problem = launch.started(process.pid) if launch else ""
    try:
        if not problem:
            problem = await asyncio.wait_for(_finish(process, readers), limits.timeout_s)
    except asyncio.TimeoutError:
        problem = f"did not exit within {limits.timeout_s:g} s (agent.program_timeout_s); its process group was killed"
    finally:
        _kill_group(process.pid)  # what it left running, or the whole run after a fault
        with contextlib.suppress(ProcessLookupError):
            await process.wait()
        for task in (*readers, feeder):
            task.cancel()
        await asyncio.gather(*readers, feeder, return_exceptions=True)
    stdout, stderr = (bytes(streams[name]).decode(errors="replace") for name in ("stdout", "stderr"))
    if launch is not None:
        problem = setup_problem(process.returncode, stderr) or problem
    value = None
    if not problem:
        try:
            value = result_value(stdout)
        except ValueError as error:
            problem = str(error)
    return CommandRun(value, problem, stdout, stderr)


async def _finish(process: asyncio.subprocess.Process, readers: list[asyncio.Future]) -> str:
    """Wait for the command to exit (or to overflow a stream); the fault, empty when none."""
    waiter = asyncio.ensure_future(process.wait())
    pending = {waiter, *readers}
    while not waiter.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not waiter and isinstance(task.exception(), _Overflow):
                waiter.cancel()
                return str(task.exception())
    _kill_group(process.pid)  # leftovers of its group would hold the pipes open
    done, _ = await asyncio.wait(readers, timeout=DRAIN_S)
    for task in done:
        if isinstance(task.exception(), _Overflow):
            return str(task.exception())
    return _exit_problem(process.returncode)


def _exit_problem(code: int | None) -> str:
    """The fault of an exit status (negative: the signal that killed it); empty for 0."""
    if code == 0:
        return ""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


async def _read_capped(stream: asyncio.StreamReader, kept: bytearray, name: str, limit: int) -> None:
    """Read ``stream`` to its end into ``kept``; :class:`_Overflow` at the first byte past ``limit``
    (the first ``limit`` bytes are kept)."""
    while chunk := await stream.read(READ_CHUNK):
        room = limit - len(kept)
        kept += chunk[: max(room, 0)]
        if len(chunk) > room:
            raise _Overflow(
                f"wrote more than {limit} bytes to {name} (agent.program_output_bytes); "
                "its process group was killed"
            )


async def _feed(process: asyncio.subprocess.Process, data: bytes) -> None:
    """The row on stdin, then end of file (a command that never reads it is not an error)."""
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.write(data)
        await process.stdin.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        process.stdin.close()


def _kill_group(pid: int) -> None:
    """SIGKILL the process group ``pid`` leads (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
