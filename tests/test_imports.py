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

share, shares = int(sys.argv[1]), int(sys.argv[2])  # this process imports every shares-th module
names = sorted(m.name for m in pkgutil.walk_packages(tandem.__path__, "tandem.") if not m.name.endswith("__main__"))
names = names[share::shares]
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


SHARES = 2  # processes at once: the walk is most of the default suite's slowest test


def test_every_module_imports_first():
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", CHECK, str(share), str(SHARES)], cwd=ROOT, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        for share in range(SHARES)
    ]
    count, failed = 0, []
    for run in runs:
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-2000:]
        share_count, *share_failed = out.strip().split("\n")
        count += int(share_count)
        failed += share_failed
    assert count > 150  # the walk found the package's modules
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
