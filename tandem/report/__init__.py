"""The run report: ``run.json`` / ``status.json`` beside a run's metrics, and one self-contained
HTML page drawn from one run or several overlaid (``tandem report``)."""

from __future__ import annotations

from pathlib import Path

from tandem.report.page import render
from tandem.report.run_info import RunInfo
from tandem.report.runs import RunData, load_run, load_runs

__all__ = ["RunData", "RunInfo", "load_run", "load_runs", "render", "write_report"]


def write_report(run_dirs: list[str | Path], target: str | Path, title: str | None = None) -> Path:
    """Draw the runs in ``run_dirs`` (one, or several to compare) into the HTML file ``target``.

    Written atomically: a browser reloading the page during a live run never reads half a file.
    """
    page = render(load_runs(list(run_dirs)), title)
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(target.name + ".tmp")
    try:
        staging.write_text(page)
        staging.replace(target)
    except BaseException:
        staging.unlink(missing_ok=True)  # a full disk leaves no partial ``.tmp`` behind
        raise
    return target
