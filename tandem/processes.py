"""This host's processes: what names one across time, and whether it has ended.

A pid alone does not name a process for long: pids are reused, machines reboot, and a container
has pids of its own. :func:`process_identity` adds the host, the pid namespace, the boot and the
process's start time, and :func:`process_gone` tells from those whether the process has ended.
The run record (``status.json``) and the shared-memory clean-up of a killed run both read it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


def proc_stat(pid: int) -> tuple[str, str] | None:
    """``(state, start time in clock ticks since boot)`` of ``pid`` from ``/proc`` (Linux), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    return fields[0], fields[19]


def boot_id() -> str | None:
    """This boot of this machine, or None where it cannot be read."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_identity(pid: int | None = None) -> dict:
    """What names process ``pid`` of this host (default: this one) across time: pid, host and
    pid namespace (a container with the host's name still has pids of its own), the machine's
    boot and the process's start (these two tell a reused pid, or a rebooted machine, from it)."""
    pid = os.getpid() if pid is None else pid
    stat = proc_stat(pid)
    return {
        "pid": pid,
        "host": socket.gethostname(),
        "pid_namespace": pid_namespace(),
        "boot_id": boot_id(),
        "process_start": stat[1] if stat else None,
    }


def on_this_machine(identity: dict) -> bool:
    """Whether ``identity`` was taken on this host, in this pid namespace, since this boot: its pid
    then names a process of this machine now, or none."""
    booted = boot_id()
    return (
        identity.get("host") == socket.gethostname()
        and identity.get("pid_namespace") == pid_namespace()
        and booted is not None
        and identity.get("boot_id") == booted
    )


def pid_unused(pid: int) -> bool:
    """Whether no running process has ``pid`` (none has it, or a zombie, dead but unreaped)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return True
    except PermissionError:  # it exists, owned by another user
        return False
    stat = proc_stat(pid)
    return stat is not None and stat[0] == "Z"


def process_gone(identity: dict) -> bool:
    """Whether the process ``identity`` names is known to have ended: it ran on this host and the
    machine has rebooted since, or no running process has its pid, or the one that has started at
    another time. False when it cannot be told (another host or pid namespace, no pid)."""
    pid = identity.get("pid")
    if type(pid) is not int or not 0 < pid < 2**22:
        return False  # 0 and negative pids would signal process groups below; 2**22 is Linux's limit
    if identity.get("host") != socket.gethostname() or identity.get("pid_namespace") != pid_namespace():
        return False
    booted = boot_id()
    if identity.get("boot_id") and booted and identity["boot_id"] != booted:
        return True
    if pid_unused(pid):
        return True
    stat = proc_stat(pid)
    return (
        stat is not None
        and identity.get("process_start") is not None
        and stat[1] != identity["process_start"]
    )
