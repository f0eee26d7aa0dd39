"""Runs whose losses, KL estimator, reward, step stage and agent loop come from the example plugins:
two data-parallel workers in spawned processes and in Ray actors give the metrics of one worker in
this process, step for step, and the metrics show each plugin ran.

In these runs the policy loss, the KL estimator, the preference loss and the agent loop run in the
workers (the update and generation); the reward function, the step stage and the estimator run on
the controller (the data plane is off). The workers import the plugin files themselves
(``TANDEM_PLUGINS``): a name a worker could not resolve would stop the run.
"""

import math

import pytest

from tests.plugins.runs import WORDS, plugin_run, write_run_files
from tests.rl.conftest import assert_same_histories

SLOW = pytest.mark.slow  # spawned processes: ~7-12 s a run on the 2-core CI host, Ray more


@pytest.fixture(scope="module")
def run_files(tmp_path_factory):
    return write_run_files(tmp_path_factory.mktemp("plugin_runs"))


@pytest.fixture(scope="module")
def in_process(run_files, tmp_path_factory):
    """Each run with one worker in this process (the reference), made once per module when first asked for."""
    histories: dict[str, list[dict]] = {}

    def history(run: str) -> list[dict]:
        if run not in histories:
            histories[run] = plugin_run(run_files, tmp_path_factory.mktemp(f"{run}_in_process"), run)
        return histories[run]

    return history


def _check_grpo_ran_the_plugins(history: list[dict]) -> None:
    assert [step["step"] for step in history] == [1, 2]
    for step in history:
        assert step["agent/turns/mean"] == 2.0  # revise_once: single_turn would give 1
        assert "actor/pg_clipfrac" in step and "actor/pg_clipfrac_lower" not in step  # ppo reports both
        assert step["critic/score/min"] < 0  # word_overlap scores >= 0: the token_cost stage lowered them
        assert step["critic/score/max"] > step["critic/score/min"]  # GRPO has advantages to work with
    assert history[0]["actor/kl_loss"] == 0.0 < history[1]["actor/kl_loss"]  # k3_unclamped, once moved


def _check_online_dpo_ran_the_plugins(history: list[dict]) -> None:
    assert [step["step"] for step in history] == [1, 2]
    for step in history:
        assert step["agent/turns/mean"] == 2.0
        assert step["online_dpo/groups_with_preference"] > 0
        found = step["critic/score/max"] * len(WORDS)  # word_overlap: the share of the 62 words found
        assert found >= 1 and found == pytest.approx(round(found), abs=1e-4)
    # the first step's policy is the reference: logistic_margin is -log sigmoid(0) on every pair
    assert history[0]["actor/preference_loss"] == pytest.approx(math.log(2), abs=1e-6)


CHECKS = {"grpo": _check_grpo_ran_the_plugins, "online_dpo": _check_online_dpo_ran_the_plugins}


def test_one_grpo_run_in_process_calls_each_plugin(in_process):
    """The reference run of the tests below, and this tier's: the plugins' marks in its metrics."""
    _check_grpo_ran_the_plugins(in_process("grpo"))


@pytest.mark.parametrize(
    "run,backend",
    [
        pytest.param("grpo", "local", marks=SLOW),
        pytest.param("online_dpo", "local", marks=SLOW),
        pytest.param("grpo", "ray", marks=SLOW),
        pytest.param("online_dpo", "ray", marks=SLOW),
    ],
    ids=["grpo-processes", "online_dpo-processes", "grpo-ray", "online_dpo-ray"],
)
def test_two_workers_run_the_plugins_as_one_worker_here(
    run_files, in_process, tmp_path, run, backend, request
):
    """``trainer.backend=local`` with two workers spawns two processes; ``ray`` starts two actors.
    Held to 1e-4 relative, as tests/rl/test_distributed.py holds two workers against one: the
    update's sums split over two ranks (its token means, ``actor/entropy`` among them, are one mean
    over the mini-batch's tokens for any split: tandem.rl.metric_shares)."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    two = plugin_run(run_files, tmp_path, run, "trainer.n_workers=2", f"trainer.backend={backend}")
    CHECKS[run](two)
    assert_same_histories(in_process(run), two, relative=1e-4)
