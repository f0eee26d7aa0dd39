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
from collections.abc import Iterable
from pathlib import Path

from tandem.processes import on_this_machine, pid_unused, process_identity

RECORD = ".processes.json"
FILE_NAME = re.compile(r"^tandem-[a-z]+-(\d+)-")  # tandem-<kind>-<pid>-...: the creating process


def record_processes(output_dir: str | os.PathLike, pids: Iterable[int], directories: Iterable[str]) -> None:
    """Note that ``pids`` (processes of this host) belong to the run in ``output_dir`` and keep
    their shared-memory files in ``directories``; each is recorded with what names it across
    time (:func:`tandem.processes.process_identity`), so a reused pid is never taken for it."""
    record = {
        "processes": [process_identity(pid) for pid in sorted({int(pid) for pid in pids})],
        "directories": sorted(set(directories)),
    }
    path = Path(output_dir) / RECORD
    staging = path.with_name(RECORD + ".tmp")
    staging.write_text(json.dumps(record))
    os.replace(staging, path)


def remove_leftovers(output_dir: str | os.PathLike) -> int:
    """Delete the shared-memory files of the recorded processes of the last run in
    ``output_dir`` whose pid no running process has (same host and boot); returns how many were
    deleted. A pid that a new process has taken keeps its files: they may be the new one's."""
    try:
        record = json.loads((Path(output_dir) / RECORD).read_text())
    except (OSError, ValueError):
        return 0
    gone = {
        p["pid"]
        for p in record.get("processes", [])
        if isinstance(p, dict)
        and type(p.get("pid")) is int
        and p["pid"] > 0
        and on_this_machine(p)
        and pid_unused(p["pid"])
    }
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
