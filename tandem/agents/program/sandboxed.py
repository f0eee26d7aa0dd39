"""A command program in the OS sandbox (``agent.program_sandbox=true``): what it is started as,
and its route to the endpoint.

The command runs inside :mod:`~tandem.agents.program.sandboxed_child` (the isolation of
:func:`~tandem.agents.sandbox.run_python`: its own network, PID, mount, IPC and user
namespaces, a read-only root of the system's files and the Python runtime, a fresh writable
``/sandbox`` as its working, home and temp directory, no capabilities), under ``agent.python``'s
memory, file-size and process limits with its CPU time capped at ``agent.program_timeout_s``
(the wall clock and the output caps stay :mod:`~tandem.agents.program.command`'s). Its network
reaches one address: the endpoint, relayed in through a Unix socket
(:mod:`~tandem.agents.program.relay`) to the sandbox's own ``127.0.0.1`` at the endpoint's
port, so ``OPENAI_BASE_URL`` is the same URL as outside. Its environment is the sandbox's
(``PATH``, ``LANG``, ``HOME``/``TMPDIR``) plus ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``:
none of the run's own variables. Of the host's files it sees only those its arguments name
(each argument naming an existing file is mounted read-only at its absolute path, and passed as
that path) and those ``agent.program_sandbox_mounts`` lists (read-only, at their absolute
paths); a bare program name is looked up on the sandbox's ``PATH`` (the run's Python's
directory, ``/usr/local/bin``, ``/usr/bin``, ``/bin``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlsplit

from tandem.agents.program.relay import SOCKET_NAME, unix_relay
from tandem.agents.sandbox import (
    SETUP_FAILED,
    SandboxLimits,
    SandboxUnavailable,
    cap_processes,
    child_limits,
    mount_paths,
    release_processes_cap,
    sandbox_environment,
)

CHILD = Path(__file__).with_name("sandboxed_child.py")


@dataclass
class SandboxLaunch:
    """How to start one sandboxed command: ``argv`` and ``environment`` for the subprocess, the
    ``go`` pipe it waits on (its read end passed to it), its process cap once started."""

    argv: list[str]
    environment: dict[str, str]
    go_read: int
    go_write: int
    processes: int
    cgroup: Path | None = None

    def started(self, pid: int) -> str:
        """The command's process ``pid`` exists: cap its processes, then let it go; the fault
        (empty: none)."""
        self._close_read()
        try:
            self.cgroup = cap_processes(pid, self.processes)
        except SandboxUnavailable as error:
            return f"could not start in the OS sandbox (agent.program_sandbox): {error}"
        os.write(self.go_write, b"g")
        return ""

    def finished(self) -> None:
        """The command is over (or never started): close the pipe, remove the process cap."""
        self._close_read()
        if self.go_write >= 0:
            os.close(self.go_write)
            self.go_write = -1
        release_processes_cap(self.cgroup)

    def _close_read(self) -> None:
        if self.go_read >= 0:  # once only: a closed descriptor's number may be reused at once
            os.close(self.go_read)
            self.go_read = -1


def setup_problem(code: int | None, stderr: str) -> str:
    """The fault of a sandbox that could not be set up (empty when it was)."""
    if code != SETUP_FAILED or "sandbox setup failed" not in stderr:
        return ""
    reason = next(line for line in reversed(stderr.splitlines()) if "sandbox setup failed" in line)
    return f"could not start in the OS sandbox (agent.program_sandbox): {reason.strip()}"


def command_files(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` with each argument that names an existing file made absolute, and those files."""
    inner, files = [], []
    for argument in argv:
        if os.path.isfile(argument):
            argument = os.path.abspath(argument)
            files.append(argument)
        inner.append(argument)
    return inner, files


@contextlib.asynccontextmanager
async def sandboxed(
    argv: Sequence[str], base_url: str, api_key: str, limits: SandboxLimits, timeout_s: float,
    extra_mounts: Sequence[str] = (),
) -> AsyncIterator[SandboxLaunch]:
    """The launch of ``argv`` in a fresh sandbox whose ``127.0.0.1`` relays to ``base_url``'s
    endpoint, for the block (see the module docstring); ``extra_mounts`` are more host paths it
    sees read-only (``agent.program_sandbox_mounts``)."""
    address = urlsplit(base_url)
    async with unix_relay(address.hostname, address.port) as socket_directory:
        with tempfile.TemporaryDirectory(prefix="tandem-program-") as base:
            workdir, root = os.path.join(base, "work"), os.path.join(base, "root")
            os.mkdir(workdir)
            os.mkdir(root)  # the child mounts its new root here, in its own mount namespace
            inner, files = command_files(argv)
            go_read, go_write = os.pipe()
            own = replace(limits, cpu_seconds=max(1, math.ceil(timeout_s)))
            setup = {
                "limits": child_limits(own), "workdir": workdir, "root": root,
                "mounts": mount_paths([socket_directory, *files, *extra_mounts]), "argv": inner,
                "go": go_read,
                "socket": os.path.join(socket_directory, SOCKET_NAME), "port": address.port,
            }  # fmt: skip
            environment = {**sandbox_environment(), "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
            launch = SandboxLaunch(
                [sys.executable, "-I", str(CHILD), json.dumps(setup)], environment, go_read, go_write,
                own.processes,
            )  # fmt: skip
            try:
                yield launch
            finally:
                launch.finished()
