"""Data files shared by every trainer: rows read from and written to parquet or JSON lines."""

from tandem.data.rows import check_row_file, read_rows, write_parquet, write_rows

__all__ = ["check_row_file", "read_rows", "write_parquet", "write_rows"]
