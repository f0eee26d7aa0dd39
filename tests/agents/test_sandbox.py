"""The Python sandbox: each hostile program is contained by the OS, and the caller goes on."""

import ast
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

import tandem
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
    result = run_python(code, LIMITS, read_only=[tmp_path])  # visible inside, so the write reaches the mount
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


SECRET = f"tandem-secret-{uuid.uuid4().hex}"


def test_the_environment_holds_only_the_allow_list(monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    code = (
        "import os\nprint(sorted(os.environ), os.environ['HOME'] == os.getcwd())\n"
        "print(open('/proc/self/environ', 'rb').read())\n"  # the environment the process was started with
    )
    result = run_python(code, LIMITS)
    assert result.ok, result.stderr
    assert SECRET not in result.stdout
    names, home_is_cwd = result.stdout.splitlines()[0].rsplit(" ", 1)
    assert set(ast.literal_eval(names)) <= {"PATH", "LANG", "HOME", "TMPDIR", "TMP", "TEMP"}
    assert home_is_cwd == "True"


def _secret_file(directory: Path) -> Path:
    path = directory / f".tandem-sandbox-test-{uuid.uuid4().hex}"
    path.write_text(SECRET)
    return path


def test_home_project_output_and_tmp_files_are_invisible(tmp_path):
    """A secret in the home directory, the run's output directory and /tmp, and the project's own
    files, cannot be read, listed or found from inside; the Python runtime still works."""
    output_dir = tmp_path / "outputs" / "run"
    output_dir.mkdir(parents=True)
    secrets = [_secret_file(Path.home()), _secret_file(output_dir), _secret_file(Path(tempfile.gettempdir()))]
    project_file = Path(tandem.__file__).resolve().parents[1] / "pyproject.toml"
    try:
        code = (
            "import os, json, sqlite3, numpy\n"  # stdlib, an extension module and a site-package import
            f"for path in {[str(p) for p in [*secrets, project_file]]!r}:\n"
            "    try:\n        print('READ', open(path).read())\n"
            "    except OSError as error:\n        print('HIDDEN', type(error).__name__)\n"
            f"for directory in {[str(Path.home()), str(output_dir.parent), tempfile.gettempdir()]!r}:\n"
            "    try:\n        print('LISTED', os.listdir(directory))\n"
            "    except OSError as error:\n        print('HIDDEN', type(error).__name__)\n"
        )
        result = run_python(code, SandboxLimits(wall_seconds=30))
    finally:
        for path in secrets:
            path.unlink()
    assert result.ok, result.stderr
    assert SECRET not in result.stdout and "READ" not in result.stdout
    listed = " ".join(line for line in result.stdout.splitlines() if line.startswith("LISTED"))
    assert not any(path.name in listed for path in secrets) and "outputs" not in listed
    assert result.stdout.count("HIDDEN") + result.stdout.count("LISTED") == 7


def test_host_processes_and_their_command_lines_are_invisible():
    host_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", SECRET])
    try:
        code = (
            "import os\npids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "lines = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
            "print(len(pids), [line for line in lines if b'sleep(60)' in line])\n"  # kept under output_bytes
        )
        result = run_python(code, LIMITS)
    finally:
        host_process.kill()
        host_process.wait()
    assert result.ok, result.stderr
    assert SECRET not in result.stdout
    assert int(result.stdout.split()[0]) in (0, 1)  # its own process (0: a kernel that allows no fresh /proc)


def test_an_explicitly_mounted_directory_is_visible_read_only_and_nothing_beside_it(tmp_path):
    shared, beside = tmp_path / "shared", tmp_path / "beside"
    shared.mkdir()
    beside.mkdir()
    (shared / "data.txt").write_text("visible")
    (beside / "secret.txt").write_text(SECRET)
    code = (
        f"print(open('{shared}/data.txt').read())\nimport os\nprint(os.listdir('{tmp_path}'))\n"
        f"open('{beside}/secret.txt')\n"
    )
    result = run_python(code, LIMITS, read_only=[shared])
    assert result.stdout == "visible\n['shared']\n"
    assert "FileNotFoundError" in result.stderr and SECRET not in result.stdout
    with pytest.raises(ValueError, match="does not exist"):
        run_python("", LIMITS, read_only=[tmp_path / "missing"])
