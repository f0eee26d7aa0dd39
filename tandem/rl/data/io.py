"""Writing rows of verl's schema to parquet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq


def write_parquet(rows: list[dict[str, Any]], path: str | Path) -> Path:
    """Write ``rows`` (dicts with the same keys) to ``path``, creating its folder."""
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
