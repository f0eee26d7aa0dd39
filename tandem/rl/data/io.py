"""Writing rows of verl's schema to parquet or JSON lines (the two formats the loaders read)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROW_FORMATS = (".parquet", ".jsonl")


def check_row_file(path: str | Path, field: str) -> Path:
    """``path`` as a Path; ``ValueError`` naming ``field`` unless it ends in a format we write."""
    path = Path(path)
    if path.suffix not in ROW_FORMATS:
        raise ValueError(
            f"{field} {path}: the name must end in {' or '.join(ROW_FORMATS)} (that picks the format)"
        )
    return path


def write_rows(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` (dicts with the same keys) to ``path`` as parquet or JSON lines, by its
    extension, creating its folder."""
    path = check_row_file(path, "output file")
    if path.suffix == ".parquet":
        return write_parquet(rows, path)
    _prepare(rows, path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` (dicts with the same keys) to the parquet file ``path``, creating its folder."""
    path = Path(path)
    _prepare(rows, path)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _prepare(rows: list[dict[str, Any]], path: Path) -> None:
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path.parent.mkdir(parents=True, exist_ok=True)
