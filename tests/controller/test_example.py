"""The controller example in docs/controller.md runs and prints the right numbers."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_example_runs():
    result = subprocess.run(
        [sys.executable, "examples/controller_quickstart.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "squares: [0.0, 1.0, 4.0, 9.0, 16.0]" in result.stdout
    assert "all-reduced total on each rank: [30.0, 30.0]" in result.stdout
