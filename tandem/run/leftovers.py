"""Shared-memory files that a killed run left behind, removed by the next run in its output directory.

tandem's processes name their shared-memory files ``tandem-<kind>-<pid>-...`` (weight slots,
stored samples, batches on their way to a worker) and delete them when they finish. After
``kill -9`` nobody does, and a 64 MB weight slot stays in ``/dev/shm`` until reboot. So a run
records which processes of this host it started and where their files go
(:func:`record_processes`, ``<output_dir>/.processes.json``). The next run in that output
directory removes the files of every recorded process that is gone (:func:`remove_leftovers`),
before it starts its own. A process that is still alive keeps its files, and so does every
process the record does not name.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path

RECORD = ".processes.json"
FILE_NAME = re.compile(r"^tandem-[a-z]+-(\d+)-")  # tandem-<kind>-<pid>-...: the creating process


def boot_id() -> str:
    """This boot of this machine (pids are reused across boots)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def record_processes(output_dir: str | os.PathLike, pids: Iterable[int], directories: Iterable[str]) -> None:
    """Note that ``pids`` (processes of this host) belong to the run in ``output_dir`` and keep
    their shared-memory files in ``directories``."""
    record = {
        "host": socket.gethostname(),
        "boot_id": boot_id(),
        "pids": sorted({int(pid) for pid in pids}),
        "directories": sorted(set(directories)),
    }
    path = Path(output_dir) / RECORD
    staging = path.with_name(RECORD + ".tmp")
    staging.write_text(json.dumps(record))
    os.replace(staging, path)


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive, and not ours to judge
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def remove_leftovers(output_dir: str | os.PathLike) -> int:
    """Delete the shared-memory files of the recorded processes of the last run in
    ``output_dir`` that are gone (same host, same boot); returns how many were deleted."""
    path = Path(output_dir) / RECORD
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return 0
    if record.get("host") != socket.gethostname() or record.get("boot_id") != boot_id():
        return 0
    gone = {pid for pid in record.get("pids", []) if isinstance(pid, int) and not alive(pid)}
    removed = 0
    for directory in record.get("directories", []):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            match = FILE_NAME.match(name)
            if match and int(match.group(1)) in gone:
                try:
                    os.unlink(os.path.join(directory, name))
                    removed += 1
                except OSError:
                    pass
    return removed
