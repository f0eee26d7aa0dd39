"""The Python sandbox: each hostile program is contained by the OS, and the caller goes on."""

import os
import time
from pathlib import Path

import pytest

from tandem.agents.sandbox import SandboxLimits, run_python, sandbox_available

pytestmark = pytest.mark.skipif(bool(sandbox_available()), reason=f"no sandbox here: {sandbox_available()}")

LIMITS = SandboxLimits(
    cpu_seconds=2, memory_mb=256, file_size_mb=1, processes=16, wall_seconds=10, output_bytes=1000
)


def test_a_program_runs_and_prints_in_its_own_directory():
    result = run_python(
        "import os\nopen('note.txt', 'w').write('hi')\nprint(sorted(os.listdir('.')), 6 * 7)", LIMITS
    )
    assert result.ok and result.stdout == "['note.txt'] 42\n"


def test_a_network_connection_fails():
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\nprint('connected')"
    result = run_python(code, LIMITS)
    assert result.exit_code == 1 and "connected" not in result.stdout
    assert "Network is unreachable" in result.stderr


def test_writing_outside_the_working_directory_fails_and_cannot_be_remounted(tmp_path):
    target = tmp_path / "escape.txt"
    code = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"print('remount', libc.mount(None, b'{tmp_path}', None, 0x1000 | 0x20, None))\n"  # MS_BIND|MS_REMOUNT, rw
        f"open('{target}', 'w').write('x')\n"
    )
    result = run_python(code, LIMITS)
    assert "remount -1" in result.stdout
    assert "Read-only file system" in result.stderr and not target.exists()


def test_an_infinite_loop_is_killed_at_its_cpu_limit():
    started = time.monotonic()
    result = run_python("while True:\n    pass", LIMITS)
    assert not result.ok and not result.timed_out  # the CPU limit, before the wall clock
    assert time.monotonic() - started < LIMITS.wall_seconds
    assert "limit" in result.describe()


def test_a_memory_bomb_fails_within_its_limit():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", LIMITS)
    assert result.exit_code == 1 and "MemoryError" in result.stderr


def test_a_fork_bomb_is_capped_and_dies_with_the_run():
    code = (
        "import os, time\nborn = 0\n"
        "while True:\n"
        "    try:\n        pid = os.fork()\n    except OSError:\n        break\n"
        "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    born += 1\n"
        "print('born', born)\n"
    )
    result = run_python(code, LIMITS)
    born = int(result.stdout.split()[1])
    assert 0 < born < LIMITS.processes  # the process limit stopped it
    assert result.seconds < 10  # the sleeping children died with the run instead of holding it


def test_huge_output_is_truncated_and_a_flood_is_stopped():
    result = run_python("print('x' * 100_000)", LIMITS)
    assert len(result.stdout) == LIMITS.output_bytes and result.dropped_bytes == 100_001 - LIMITS.output_bytes
    flood = run_python("while True:\n    print('y' * 10_000)", LIMITS)
    assert flood.flooded and "more than" in flood.describe()


def test_the_wall_clock_limit_ends_a_sleeping_program():
    result = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_seconds=1))
    assert result.timed_out and result.seconds < 5


def test_many_sandboxes_leave_no_process_behind():
    before = {p for p in os.listdir("/proc") if p.isdigit()}
    for _ in range(3):
        run_python("import os\nif os.fork() == 0:\n    import time; time.sleep(60)\nprint('done')", LIMITS)
    time.sleep(0.2)
    left = {p for p in os.listdir("/proc") if p.isdigit()} - before
    commands = []
    for pid in left:
        try:
            commands.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:
            continue
    assert not [c for c in commands if b"sandbox_child" in c]
