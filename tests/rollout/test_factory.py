"""The rollout factory refuses an engine whose optional package is missing, naming the key and
what to install, before anything starts: in ``tandem train`` (tests/rl/test_distributed.py)
and in ``tandem serve``."""

import importlib.util

import pytest

from tandem.cli import main
from tandem.rollout import factory
from tandem.rollout.engines import ENGINE_CLASSES, SERVING_ENGINES
from tandem.rollout.factory import check_engine_installed


def test_an_engine_whose_package_is_missing_is_refused_naming_the_key(monkeypatch):
    monkeypatch.setitem(factory.ENGINE_PACKAGES, "fancy", ("tandem_no_such_package", "pip install fancy"))
    with pytest.raises(ValueError) as error:
        check_engine_installed("fancy", "rollout.engine.name")
    assert str(error.value) == (
        "rollout.engine.name='fancy' needs the tandem_no_such_package package, which this Python lacks: "
        "pip install fancy"
    )
    monkeypatch.setitem(factory.ENGINE_PACKAGES, "fancy", ("json", "pip install fancy"))
    check_engine_installed("fancy")  # installed: no error
    check_engine_installed("native")  # needs nothing optional


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_tandem_serve_with_vllm_missing_says_so_before_loading_anything(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "no-model-needed"), "--engine", "vllm"]) == 2
    assert "tandem serve: error: --engine='vllm' needs the vllm package" in capsys.readouterr().err


def test_tandem_serve_offers_the_engines_that_generate_in_the_background(capsys):
    """``--engine``'s choices come from the engine table: every engine whose requests run on a
    thread of its own, and not ``hf``, which generates inside ``submit``."""
    assert list(SERVING_ENGINES) == [
        n for n, engine in ENGINE_CLASSES.items() if engine.generates_in_background
    ]
    assert list(SERVING_ENGINES) == ["native", "vllm"]
    with pytest.raises(SystemExit):
        main(["serve", "no-model-needed", "--engine", "hf"])
    assert "invalid choice: 'hf' (choose from 'native', 'vllm')" in capsys.readouterr().err
