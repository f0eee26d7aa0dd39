"""A GRPO run whose estimator comes from a plugin gives the built-in grpo's metrics, step for step."""

import pytest

from tandem.rl import RLTrainer
from tests.plugins.conftest import example
from tests.rl.conftest import assert_same_histories, small_config


@pytest.mark.slow  # two RL runs; the estimator's own equality is test_examples.py's fast test
def test_a_run_with_the_plugin_estimator_matches_grpo(rl_files, tmp_path):
    runs = {}
    for name, overrides in (
        ("grpo", ()),
        ("grpo_loop", (f"plugins=[{example('advantage_estimator')}]",)),
    ):
        config = small_config(rl_files, tmp_path / name, f"algorithm.adv_estimator={name}", *overrides)
        runs[name] = [h for h in RLTrainer(config).fit().history if h["step"] > 0]
    assert len(runs["grpo"]) == 2
    assert_same_histories(runs["grpo"], runs["grpo_loop"])
