"""Running untrusted Python: a separate, isolated, limited process per call.

:func:`run_python` starts ``python -I`` on :mod:`tandem.agents.sandbox_child` with the code on
stdin, in a fresh temporary working directory, with an environment of ``PATH`` and ``LANG`` only
(none of the host's secrets). The child isolates itself before any of the code runs (see its
docstring): no network (a network namespace with no usable device), a root of its own holding
only the system's libraries, the Python runtime and what the caller mounts, all read-only, plus
the working directory (home directories, ``/tmp``, the project and the run's output are not
there), its own PID namespace with its own ``/proc`` (the host's processes are not there;
everything it started dies with it), and CPU-time, memory, file-size and process-count limits.
Here the caller adds the wall-clock limit (the whole process tree is killed) and keeps at most
``output_bytes`` of stdout and of stderr (the rest is drained and counted; a run that floods
more than ``FLOOD_FACTOR`` times that is killed).

The isolation needs Linux user namespaces (or root), ``mount_setattr`` (Linux 5.12+) and a known
``pivot_root`` syscall number (x86_64, aarch64, riscv64); where they are missing the call fails
with the reason (:class:`SandboxUnavailable`) instead of running the code unisolated.
:func:`sandbox_available` checks once.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from tandem.config.validation import check_positive

CHILD = Path(__file__).with_name("sandbox_child.py")
SETUP_FAILED = 86
FLOOD_FACTOR = 1000  # output beyond this many times output_bytes ends the run


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (``agent.python.*`` in an RL config).

    Attributes:
        cpu_seconds: CPU time; the process gets SIGXCPU, then SIGKILL a second later.
        memory_mb: address space; allocations beyond it fail (``MemoryError``).
        file_size_mb: the largest file it may write.
        processes: processes and threads of the sandbox's user (as root: ``nobody``, shared by
            sandboxes running at once; otherwise added to the user's current count).
        wall_seconds: wall-clock time, after which every process of the run is killed.
        output_bytes: stdout and stderr kept (each); the rest is dropped and counted.
    """

    cpu_seconds: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    processes: int = 64
    wall_seconds: float = 20.0
    output_bytes: int = 8192
    key_prefix: ClassVar[str] = "tools.python"  # loaded at agent.python: errors name that path

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "memory_mb", "file_size_mb", "processes", "wall_seconds", "output_bytes"):
            check_positive("tools.python", name, getattr(self, name))


@dataclass
class SandboxResult:
    """How a run ended: ``exit_code`` (negative: killed by that signal), the kept output, how
    many bytes were dropped, whether the wall clock ran out, and the seconds it took."""

    exit_code: int
    stdout: str
    stderr: str
    dropped_bytes: int
    timed_out: bool
    seconds: float
    flooded: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def describe(self) -> str:
        """One line on how the run ended (empty when it exited 0)."""
        if self.flooded:
            return f"killed: wrote more than {FLOOD_FACTOR} times the output kept"
        if self.timed_out:
            return "killed: wall-clock limit reached"
        if self.exit_code == -signal.SIGXCPU or self.exit_code == 128 + signal.SIGXCPU:
            return "killed: CPU-time limit reached"
        if self.exit_code in (-signal.SIGKILL, 128 + signal.SIGKILL):
            return "killed (SIGKILL: a resource limit was reached)"
        return f"exit status {self.exit_code}" if self.exit_code else ""


class SandboxUnavailable(RuntimeError):
    """The OS cannot isolate a sandbox here (no user namespaces or ``mount_setattr``)."""


def run_python(
    code: str, limits: SandboxLimits | None = None, read_only: Sequence[str | os.PathLike] = ()
) -> SandboxResult:
    """Run ``code`` in a new sandbox (see the module docstring); raises :class:`SandboxUnavailable`
    when the isolation cannot be set up.

    ``read_only``: host files or directories the code may read, each at its own path inside (a
    tool's explicit mounts; nothing else of the host's files is there). Raises ``ValueError`` for
    a path that does not exist, or ``/``.
    """
    limits = limits or SandboxLimits()
    own_limits = child_limits(limits)
    mounts = mount_paths(read_only)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tandem-sandbox-") as base:
        workdir, root = os.path.join(base, "work"), os.path.join(base, "root")
        os.mkdir(workdir)
        os.mkdir(root)  # stays empty here: the child mounts its new root on it in its own namespace
        setup = {"limits": own_limits, "workdir": workdir, "root": root, "mounts": mounts}
        return _supervise(_start_child(setup), code, limits, started)


def child_limits(limits: SandboxLimits) -> dict:
    """The limits the child sets on itself; as a non-root user its process limit leaves room
    for the threads the user already runs (the kernel counts every thread of the uid)."""
    values = asdict(limits)
    if os.geteuid() != 0:
        values["processes"] = limits.processes + _threads_of(os.getuid())
    return values


def _start_child(setup: dict) -> subprocess.Popen:
    """``python -I`` on the sandbox's child script with ``setup`` (limits, directories, mounts),
    in its working directory, in a process group of its own, with the sandbox's environment."""
    return subprocess.Popen(
        [sys.executable, "-I", str(CHILD), json.dumps(setup)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killed as one
        cwd=setup["workdir"],
        env=sandbox_environment(),
    )


def _supervise(process: subprocess.Popen, code: str, limits: SandboxLimits, started: float) -> SandboxResult:
    """Hand ``code`` to the started child and see its run through: output capped (a flood kills
    it), the process count capped by a pids cgroup as root, the wall clock enforced (the whole
    group killed); :class:`SandboxUnavailable` when the child could not isolate itself."""
    flooded = threading.Event()

    def flood() -> None:
        flooded.set()
        _kill_group_quietly(process.pid)

    readers = [_Capped(pipe, limits.output_bytes, flood) for pipe in (process.stdout, process.stderr)]
    cgroup = _join_pids_cgroup(process.pid, limits.processes) if os.geteuid() == 0 else None
    try:
        process.stdin.write(code.encode())
        process.stdin.close()
    except BrokenPipeError:
        pass
    timed_out = False
    try:
        process.wait(timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(process)
    for reader in readers:
        reader.join()
    if cgroup is not None:
        _remove_cgroup(cgroup)
    stdout, stderr = (reader.text() for reader in readers)
    if process.returncode == SETUP_FAILED and "sandbox setup failed" in stderr:
        raise SandboxUnavailable(stderr.strip().splitlines()[-1])
    return SandboxResult(
        process.returncode,
        stdout,
        stderr,
        sum(reader.dropped for reader in readers),
        timed_out,
        time.monotonic() - started,
        flooded.is_set(),
    )


def sandbox_environment() -> dict[str, str]:
    """The whole environment the sandbox starts with: never the host's (API keys, tokens). The
    child adds ``HOME`` and ``TMPDIR``, both its working directory."""
    return {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def mount_paths(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Absolute host paths to mount read-only, checked here so a typo is an error, not a failed setup."""
    mounts = []
    for path in paths:
        absolute = os.path.abspath(path)
        if absolute == "/" or not os.path.exists(absolute):
            raise ValueError(f"read_only: {path!r} does not exist or is / (the whole filesystem)")
        mounts.append(absolute)
    return mounts


@functools.cache
def sandbox_available() -> str:
    """Empty when sandboxes work here, else why not (checked once per process)."""
    try:
        result = run_python("print('ok')", SandboxLimits(wall_seconds=30))
    except SandboxUnavailable as error:
        return str(error)
    return "" if result.stdout.strip() == "ok" else f"a trial run failed: {result.stderr.strip()[-200:]}"


class _Capped(threading.Thread):
    """Reads a pipe to its end, keeping the first ``limit`` bytes."""

    def __init__(self, pipe, limit: int, flood: Callable[[], None]) -> None:
        super().__init__(daemon=True)
        self.pipe, self.limit, self.flood = pipe, limit, flood
        self.kept = bytearray()
        self.dropped = 0
        self.start()

    def run(self) -> None:
        while chunk := self.pipe.read1(65536):
            room = self.limit - len(self.kept)
            self.kept += chunk[:room]
            self.dropped += max(0, len(chunk) - room)
            if self.dropped > FLOOD_FACTOR * self.limit:
                self.flood()
        self.pipe.close()

    def text(self) -> str:
        return self.kept.decode(errors="replace")


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the run's process group; its PID-namespace init dies with it (and with that init,
    every process in the namespace)."""
    _kill_group_quietly(process.pid)
    process.wait()


def cap_processes(pid: int, limit: int) -> Path | None:
    """As root, put ``pid`` (before it runs any code) in a pids cgroup capped at ``limit`` and
    return the group, for :func:`release_processes_cap` after the run (the kernel does not count
    root's processes against the child's ``RLIMIT_NPROC``); otherwise None, the rlimit caps it.
    Raises :class:`SandboxUnavailable` as root when no pids cgroup is writable (``pid``'s group is
    killed then)."""
    return _join_pids_cgroup(pid, limit) if os.geteuid() == 0 else None


def release_processes_cap(group: Path | None) -> None:
    """Remove a group :func:`cap_processes` made, once its processes have ended."""
    if group is not None:
        _remove_cgroup(group)


PIDS_HIERARCHIES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


def _join_pids_cgroup(pid: int, limit: int) -> Path:
    """Put ``pid`` (before it runs any code: the code is written to its stdin after this) in a
    new pids cgroup capped at ``limit`` processes; the kernel does not count root's processes
    against ``RLIMIT_NPROC``. Raises :class:`SandboxUnavailable` when no pids cgroup is writable."""
    for base in PIDS_HIERARCHIES:
        if not (base / "cgroup.procs").exists():
            continue
        if (base / "cgroup.controllers").exists():  # cgroup v2: pids must be enabled for children
            if "pids" not in (base / "cgroup.controllers").read_text().split():
                continue
            try:
                (base / "cgroup.subtree_control").write_text("+pids")
            except OSError:
                continue
        group = base / f"tandem-sandbox-{pid}"
        try:
            group.mkdir()
            (group / "pids.max").write_text(str(limit))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError:
            _remove_cgroup(group)
            continue
        return group
    _kill_group_quietly(pid)
    raise SandboxUnavailable(
        "sandbox setup failed: as root the process limit needs a writable pids cgroup "
        f"(none under {', '.join(map(str, PIDS_HIERARCHIES))}); run as a non-root user"
    )


def _remove_cgroup(group: Path) -> None:
    for _ in range(50):  # the kernel empties it a moment after the last process ends
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.02)


def _kill_group_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _threads_of(uid: int) -> int:
    """Threads the kernel counts against ``uid``'s process limit right now."""
    count = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count
