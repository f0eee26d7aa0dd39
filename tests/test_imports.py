"""Every module of the package imports on its own, first: no circular import that only works when
some other module happened to load first (``tandem.pipeline.runner`` once failed that way)."""

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import tandem
from tests.conftest import ROOT

CHECK = """
import importlib, pkgutil, sys, traceback
import tandem

names = sorted(m.name for m in pkgutil.walk_packages(tandem.__path__, "tandem.") if not m.name.endswith("__main__"))
failed = []
for name in names:
    for loaded in [m for m in sys.modules if m == "tandem" or m.startswith("tandem.")]:
        del sys.modules[loaded]  # tandem's modules load afresh; torch & co. stay loaded, for speed
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-2))
print(len(names))
print("\\n".join(failed))
"""


def test_every_module_imports_first():
    done = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    count, *failed = done.stdout.strip().split("\n")
    assert int(count) > 150  # the walk found the package's modules
    assert not "\n".join(failed).strip(), "\n".join(failed)


def test_the_layer_contract_names_every_top_level_module():
    """docs/architecture.md's layers cover the whole package: a new top-level package or module
    must be given its layer in pyproject.toml (``lint-imports`` then checks its imports)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    contracts = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {part.strip() for layer in layers for part in layer.replace(":", "|").split("|")}
    present = {f"tandem.{m.name}" for m in pkgutil.iter_modules(tandem.__path__)}
    assert present == named, f"not in a layer: {sorted(present - named)}; gone: {sorted(named - present)}"
