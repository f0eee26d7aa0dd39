"""docs/architecture.md's layer picture draws the layers contract of ``pyproject.toml``: one row
per layer, in the contract's order, with the same packages (``run``, ``report``, ``serve`` and
``sft`` were once drawn away from where their imports put them)."""

import re
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _contract_layers() -> list[set[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    return [{part.strip().removeprefix("tandem.") for part in re.split(r"[|:]", layer)} for layer in layers]


def _picture_rows() -> list[set[str]]:
    """Each row's packages: the text before its description (three or more spaces), split on
    ``|`` and ``:``."""
    text = (Path(ROOT) / "docs" / "architecture.md").read_text()
    rows = []
    for line in text.splitlines():
        if line.startswith(" │") and line.endswith("│"):
            names = re.split(r"\s{3,}", line.strip().strip("│").strip())[0]
            rows.append({name.strip() for name in re.split(r"[|:]", names)})
    return rows


def test_the_layer_picture_draws_the_contract_row_by_row():
    assert _picture_rows() == _contract_layers()
