"""Data files shared by every trainer: rows read from and written to parquet or JSON lines, and
the list of files a data-path setting names."""

from tandem.data.file_lists import file_list
from tandem.data.rows import check_row_file, read_rows, write_parquet, write_rows

__all__ = ["check_row_file", "file_list", "read_rows", "write_parquet", "write_rows"]
