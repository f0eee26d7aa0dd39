"""Row files: reading and writing rows (dicts) as parquet or JSON lines, the two formats every loader reads."""

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


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of a parquet or JSONL file as dicts; ``ValueError`` naming the file when it is a
    directory or not a readable file of its format."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"data file {path} does not exist")
    if path.is_dir():
        raise ValueError(
            f"data file {path} is a directory; give a .parquet or .jsonl file "
            "(list several as [a.parquet,b.parquet])"
        )
    if path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return _read_json_lines(path)
    raise ValueError(f"data file {path} must end in .parquet or .jsonl")


def _read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The rows of one JSONL file. Invalid UTF-8, invalid JSON and a lone surrogate (``"\\ud800"``:
    valid JSON, but no text, so the tokenizer refuses it) are each a ``ValueError`` naming the file,
    the line (and the row, counting rows as the trainers do) and the byte or field."""
    rows: list[dict[str, Any]] = []
    for line_number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{path}: line {line_number}: byte {error.start + 1} ({raw[error.start : error.start + 1]!r}) "
                f"is not valid UTF-8 ({error.reason}); save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: line {line_number} is not valid JSON: {error}") from None
        where = f"{path}: line {line_number} (row {len(rows)})"
        _check_surrogates(row, where, "")
        rows.append(row)
    return rows


def _check_surrogates(value: Any, where: str, field: str) -> None:
    """Raise ``ValueError`` naming ``where`` and the field path when a string in ``value`` holds a
    lone UTF-16 surrogate (``\\ud800``-``\\udfff`` escaped alone in JSON)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # fails exactly on a lone surrogate, at C speed
        except UnicodeEncodeError as error:
            raise ValueError(
                f"{where}: field {_printable(field) or '(the row)'!r} holds a lone surrogate "
                f"\\u{ord(value[error.start]):04x} at character {error.start}, which is not text; a JSON "
                "\\u escape outside the Basic Multilingual Plane must be a pair (\\ud83d\\ude00)"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            path = f"{field}.{key}" if field else str(key)
            _check_surrogates(key, where, f"{path} (a key)")
            _check_surrogates(item, where, path)
    elif isinstance(value, list):
        for number, item in enumerate(value):
            _check_surrogates(item, where, f"{field}[{number}]")


def _printable(text: str) -> str:
    """``text`` with any surrogate escaped, so the message itself can be printed."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    """The rows of one parquet file; a truncated or corrupt file is a ``ValueError`` naming it
    (pyarrow raises ``ArrowInvalid`` or a thrift ``OSError`` that names neither cause nor fix)."""
    try:
        return pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as error:
        raise ValueError(f"data file {path} is not a readable parquet file ({error})") from None
