"""Online DPO in the RL trainer (``preset=online_dpo``): best/worst pairs of each prompt's
responses, the preference loss against the reference, the same result on one worker or two."""

import math

import pytest
import torch

from tandem.protocol import Batch
from tandem.rl import RLTrainer
from tandem.rl.preference_pairs import best_worst_pairs
from tests.rl.conftest import small_config


def scored_groups(scores: list[list[float]]) -> Batch:
    """A scored batch of ``len(scores)`` groups; each response's score sits on its last token."""
    flat = torch.tensor(scores).flatten()
    rows, width = len(flat), 3
    token_scores = torch.zeros(rows, width)
    token_scores[:, -1] = flat
    return Batch(
        {
            "prompts": torch.arange(rows).repeat_interleave(2).view(rows, 2),
            "responses": torch.arange(rows * width).view(rows, width),
            "response_mask": torch.ones(rows, width, dtype=torch.long),
            "token_level_scores": token_scores,
        }
    )


def test_pairs_are_each_groups_best_and_worst_and_ties_state_no_preference():
    batch = scored_groups([[0.1, 0.9, 0.5], [0.3, 0.3, 0.3], [1.0, 0.0, 0.2], [0.2, 0.4, 0.6]])
    pairs, metrics = best_worst_pairs(batch, n=3, world_size=1)
    assert pairs["token_level_scores"].sum(-1).tolist() == pytest.approx([0.9, 0.1, 1.0, 0.0, 0.6, 0.2])
    assert pairs["chosen"].tolist() == [1, 0] * 3 and pairs["pair"].tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(pairs["micro_batch_unit"], pairs["pair"])
    assert pairs["loss_mask"][:, :2].sum() == 0 and torch.equal(
        pairs["loss_mask"][:, 2:], pairs["response_mask"]
    )
    assert metrics["online_dpo/groups_with_preference"] == pytest.approx(0.75)
    halves, _ = best_worst_pairs(batch, n=3, world_size=2)  # whole pairs per worker: 3 -> 2
    assert len(halves) == 4
    assert best_worst_pairs(scored_groups([[0.5, 0.5]]), n=2, world_size=1)[0] is None


def _online_dpo(rl_files, output_dir, *overrides):
    config = small_config(rl_files, output_dir, "preset=online_dpo", "trainer.total_steps=3", *overrides)
    return RLTrainer(config).fit()


def test_online_dpo_trains_pairs_against_the_reference(rl_files, tmp_path):
    result = _online_dpo(rl_files, tmp_path)
    steps = [h for h in result.history if h["step"] > 0]
    assert steps[0]["actor/preference_loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    for metrics in steps:
        assert metrics["online_dpo/chosen_score"] > metrics["online_dpo/rejected_score"]
        for name in ("actor/grad_norm", "rewards/accuracies", "logps/chosen", "critic/score/mean"):
            assert math.isfinite(metrics[name]), name
        assert "timing_s/old_log_prob" not in metrics and "critic/advantages/mean" not in metrics
    assert steps[1]["actor/preference_loss"] != steps[0]["actor/preference_loss"]  # the policy moved


def test_two_workers_train_the_same_pairs_as_one(rl_files, tmp_path):
    one = _online_dpo(rl_files, tmp_path / "one")
    two = _online_dpo(rl_files, tmp_path / "two", "trainer.n_workers=2")
    for a, b in zip(one.history, two.history, strict=True):
        if a["step"] == 0:
            continue
        assert a["online_dpo/groups_with_preference"] == 1.0 == b["online_dpo/groups_with_preference"]
        for name in ("actor/preference_loss", "rewards/margins", "critic/score/mean"):
            assert b[name] == pytest.approx(a[name], rel=1e-3, abs=1e-5), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("rollout.n=1",), "rollout.n must be at least 2"),
        (("actor.ppo_mini_batch_size=2",), "leave actor.ppo_mini_batch_size unset"),
        (("algorithm.kl.use_kl_loss=true", "algorithm.kl.kl_loss_coef=0.1"), "turn algorithm.kl.use_kl_loss"),
        (("actor.preference.beta=0",), "preference.beta"),
    ],
)
def test_online_dpo_settings_that_do_not_apply_are_named(rl_files, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        small_config(rl_files, tmp_path, "preset=online_dpo", *overrides)
