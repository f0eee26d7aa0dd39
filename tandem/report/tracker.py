"""The live report: a tracker that redraws ``report.html`` while a run trains."""

from __future__ import annotations

import contextlib
from pathlib import Path

from tandem.report import write_report

REPORT_FILE = "report.html"


class ReportTracker:
    """Rewrites ``<run_dir>/report.html`` from the run's files every ``every`` steps, after each
    validation, and when the run ends (``close``). Put it after the JSONL tracker, whose file it
    reads. ``every=0``: only at the end.

    A redraw costs tens of milliseconds and writes ~5 MB (plotly.js is inlined).
    """

    def __init__(self, run_dir: Path, every: int) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / REPORT_FILE
        self.every = every

    def log(self, metrics: dict[str, float], step: int) -> None:
        validated = any(name.startswith("val-core/") for name in metrics)
        if validated or (self.every and step % self.every == 0):
            self._draw()

    def close(self) -> None:
        self._draw()

    def _draw(self) -> None:
        if (self.run_dir / "metrics.jsonl").exists():
            with contextlib.suppress(ValueError):  # no step logged yet: nothing to draw
                write_report([self.run_dir], self.path)
