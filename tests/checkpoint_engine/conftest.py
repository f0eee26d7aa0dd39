"""The tiny model fixture of the engine tests."""

from tests.engine.conftest import tiny_model_dir  # noqa: F401 (a fixture)
