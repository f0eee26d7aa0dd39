"""The step-stage example plugin: its stage lowers each score by the cost worked out by hand, joins
the step plan only when the run picks its estimator, and in a run lowers the first step's scores
by exactly that cost against the same run without it."""

import pytest
import torch

from tandem.config.plugins import load_plugins
from tandem.protocol import Batch
from tandem.rl import RLTrainer, load_train_config
from tandem.rl.stages import STEP_STAGES
from tandem.rl.step_plan import build_step_plan
from tests.plugins.conftest import example
from tests.rl.conftest import small_config

BASE = ["model_path=/m", "data.train_path=/d"]


def test_the_stage_takes_the_cost_of_each_response_from_the_token_holding_its_score():
    load_plugins([example("step_stage")])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    scored = STEP_STAGES.get("token_cost")(
        None, Batch({"response_mask": mask, "token_level_scores": scores}), {}
    )
    expected = torch.tensor([[0.0, 0.0, 0.85, 0.0], [0.45, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, -0.2]])  # by hand
    torch.testing.assert_close(scored["token_level_scores"], expected)
    assert scores[0, 2] == 1.0  # the input is left as it was


def test_the_stage_joins_the_plan_of_a_run_that_picks_its_estimator():
    load_plugins([example("step_stage")])
    mine = build_step_plan(load_train_config([*BASE, "algorithm.adv_estimator=grpo_token_cost"]))
    assert mine.names()["draw"] == ("token_cost",)
    assert "collect one_draw (draw: token_cost)" in mine.describe()
    assert build_step_plan(load_train_config(BASE)).names()["draw"] == ()


@pytest.mark.slow  # two RL runs; the stage's own values are the fast test above
def test_a_run_with_the_stage_scores_its_first_step_lower_by_the_cost(rl_files, tmp_path):
    firsts = {}
    for name, overrides in (
        ("grpo", ()),
        ("grpo_token_cost", (f"plugins=[{example('step_stage')}]",)),
    ):
        config = small_config(
            rl_files,
            tmp_path / name,
            f"algorithm.adv_estimator={name}",
            "trainer.total_steps=1",
            "data.val_path=",
            *overrides,
        )
        (firsts[name],) = RLTrainer(config).fit().history
    grpo, mine = firsts["grpo"], firsts["grpo_token_cost"]
    assert (
        mine["response_length/mean"] == grpo["response_length/mean"]
    )  # the same responses: same weights, seed
    cost = 0.05 * grpo["response_length/mean"]
    assert mine["critic/score/mean"] == pytest.approx(grpo["critic/score/mean"] - cost, abs=1e-6)
    assert mine["actor/pg_loss"] != grpo["actor/pg_loss"]  # the advantages of the lowered scores
