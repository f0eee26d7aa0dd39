"""Reading run directories for the report: ``metrics.jsonl`` (required), ``run.json`` and
``status.json`` (when present), with errors that say what is missing."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from tandem.report.run_info import RUN_FILE, STATUS_FILE, read_json, settled_status

METRICS_FILE = "metrics.jsonl"


@dataclass
class RunData:
    """One run as the report sees it.

    Attributes:
        name: the legend label (the experiment name, made unique among the compared runs).
        directory: the run's output directory.
        records: one dict per logged step, ``{"step": int, metric: float | None, ...}``
            (non-finite values become None so charts show a gap).
        info: ``run.json`` (empty for runs written before it existed).
        status: ``status.json`` (empty likewise); ``interrupted`` in place of a ``running`` whose
            process is gone (:func:`~tandem.report.run_info.settled_status`).
    """

    name: str
    directory: Path
    records: list[dict]
    info: dict
    status: dict

    def metric_names(self) -> set[str]:
        return {key for record in self.records for key in record if key != "step"}


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        number = float(value)  # the JSONL tracker writes non-finite values as "nan" / "inf"
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _step(value: object) -> int:
    """A record's ``step`` as an int: an integer 0 or more (``3.0`` reads as 3); anything else,
    a string, a list, NaN or a bool included, is a ValueError naming the value."""
    whole = isinstance(value, float) and math.isfinite(value) and value.is_integer()
    if isinstance(value, bool) or not (isinstance(value, int) or whole):
        raise ValueError(f"'step' must be an integer, got {value!r}")
    if value < 0:
        raise ValueError(f"'step' must be 0 or more, got {value!r}")
    return int(value)


def read_records(path: Path) -> list[dict]:
    """The step records of a ``metrics.jsonl``; a malformed line is named by its number."""
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path} line {number} is not JSON ({error})") from None
        if not isinstance(raw, dict) or "step" not in raw:
            raise ValueError(f"{path} line {number} has no 'step' field")
        try:
            record = {"step": _step(raw["step"])}
        except ValueError as error:
            raise ValueError(f"{path} line {number}: {error}") from None
        record.update({k: _number(v) for k, v in raw.items() if k != "step"})
        records.append(record)
    return records


def load_run(directory: str | Path) -> RunData:
    """Load a run's output directory (``trainer.output_dir``).

    Raises:
        FileNotFoundError: the directory, or its ``metrics.jsonl``, does not exist.
        ValueError: ``metrics.jsonl`` is empty or malformed.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"run directory {directory} does not exist")
    metrics = directory / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(
            f"{directory} has no {METRICS_FILE}: name a run's trainer.output_dir "
            "(the run must log with the jsonl logger, as it does by default)"
        )
    records = read_records(metrics)
    if not records:
        raise ValueError(f"{metrics} has no records yet: the run has not finished a step")
    info = read_json(directory / RUN_FILE)
    return RunData(
        name=str(info.get("experiment") or directory.name),
        directory=directory,
        records=records,
        info=info,
        status=settled_status(read_json(directory / STATUS_FILE)),
    )


def load_runs(directories: list[str | Path]) -> list[RunData]:
    """Load several runs; legend names that collide get their directory appended."""
    if not directories:
        raise ValueError("name at least one run directory")
    runs = [load_run(d) for d in directories]
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.name} ({run.directory})"
    return runs
