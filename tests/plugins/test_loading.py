"""Plugins load before the config validates, once per process, and a broken one is one line naming the file."""

import os
from pathlib import Path

import pytest

from tandem.algos import ADVANTAGE_ESTIMATORS
from tandem.config.overrides import config_from_overrides
from tandem.config.paths import with_absolute_paths
from tandem.config.plugins import load_plugins, loaded_plugins, plugin_of, plugins_env
from tandem.dpo import DPOConfig
from tandem.rl import load_train_config
from tandem.sft import SFTConfig
from tests.plugins.conftest import EXAMPLES, example

BASE = ["model_path=m", "data.train_path=t.parquet"]


def test_a_plugin_s_names_validate_like_built_in_ones(monkeypatch):
    monkeypatch.chdir(EXAMPLES.parent)  # examples/: the plugin's path is relative
    config = load_train_config(
        [*BASE, "plugins=[plugins/advantage_estimator.py]", "algorithm.adv_estimator=grpo_loop"]
    )
    assert config.algorithm.adv_estimator == "grpo_loop" and config.algorithm.compares_groups
    assert list(config.plugins) == ["plugins/advantage_estimator.py"]
    assert list(with_absolute_paths(config).plugins) == [
        example("advantage_estimator")
    ]  # before workers start
    with pytest.raises(ValueError) as error:
        load_train_config([*BASE, "algorithm.adv_estimator=grpo_lop"])
    assert str(error.value).endswith("; did you mean 'grpo_loop'?")
    assert str(error.value).startswith(
        "algorithm.adv_estimator='grpo_lop' is not registered; choose one of ["
    )


def test_the_command_line_s_plugins_come_first_and_each_file_loads_once():
    config = load_train_config(
        [
            *BASE,
            f"plugins=[{example('advantage_estimator')},{example('policy_loss')}]",
            "actor.policy_loss.name=ppo_clip_only",
        ],
        plugins=[example("policy_loss")],
    )
    assert list(config.plugins) == [example("policy_loss"), example("advantage_estimator")]
    assert loaded_plugins() == (example("policy_loss"), example("advantage_estimator"))
    load_plugins([example("advantage_estimator")])  # again: no duplicate-name error
    assert plugin_of(ADVANTAGE_ESTIMATORS.get("grpo_loop")) == example("advantage_estimator")
    assert plugin_of(ADVANTAGE_ESTIMATORS.get("grpo")) is None
    assert plugins_env() == {"TANDEM_PLUGINS": os.pathsep.join(loaded_plugins())}


def test_sft_dpo_and_rm_configs_load_their_plugins_before_validating():
    dpo = config_from_overrides(
        DPOConfig, [*BASE, f"plugins=[{example('preference_loss')}]", "preference.name=logistic_margin"]
    )
    assert dpo.preference.name == "logistic_margin" and list(dpo.plugins) == [example("preference_loss")]
    sft = config_from_overrides(SFTConfig, BASE, plugins=[example("kl_estimator")])
    assert list(sft.plugins) == [example("kl_estimator")] and loaded_plugins() == (
        example("preference_loss"),
        example("kl_estimator"),
    )


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "is not a file"),
        ("def broken(:\n", ": line 1: SyntaxError: invalid syntax"),
        ("import os\nraise RuntimeError('no GPU here')\n", ": line 2: RuntimeError: no GPU here"),
        (
            "from tandem.algos import register_advantage_estimator\n\n"
            "@register_advantage_estimator('grpo')\ndef mine(inputs, config):\n    pass\n",
            ": line 3: ValueError: advantage estimator 'grpo' is already registered (by 'compute_grpo_advantage')",
        ),
    ],
    ids=["missing", "syntax", "raises", "duplicate"],
)
def test_a_broken_plugin_is_one_line_naming_the_file_and_the_reason(tmp_path, text, reason):
    path = str(tmp_path / "mine.py") if text is None else _write(tmp_path, "mine.py", text)
    with pytest.raises((ValueError, FileNotFoundError)) as error:
        load_train_config([*BASE, f"plugins=[{path}]"])
    separator = " " if text is None else ""
    assert str(error.value) == f"plugins={path!r}{separator}{reason}"
    assert loaded_plugins() == ()


def test_two_plugins_that_register_one_name_are_an_error_naming_the_second(tmp_path):
    copy = _write(tmp_path, "copy.py", Path(example("advantage_estimator")).read_text())
    with pytest.raises(ValueError) as error:
        load_plugins([example("advantage_estimator"), copy], "--plugin")
    assert str(error.value).startswith(
        f"--plugin={copy!r}: line 14: ValueError: advantage estimator 'grpo_loop'"
    )
    assert loaded_plugins() == (example("advantage_estimator"),)
