"""A real, small, full-able file system for the tests of saving on a full disk."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def mounted_tmpfs(mount_point, size: str):
    """A tmpfs of ``size`` (``1m``, ``64m``) mounted at the new folder ``mount_point`` while the
    block runs (needs root; the test is skipped, with the reason, elsewhere)."""
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path / "disk"``."""
    with mounted_tmpfs(tmp_path / "disk", "1m") as disk:
        yield disk


def fill(disk, leave: int) -> None:
    """Fill ``disk`` until ``leave`` bytes are free (a file named ``filler``)."""
    stats = os.statvfs(disk)
    (disk / "filler").write_bytes(b"\0" * max(stats.f_bavail * stats.f_frsize - leave, 0))
