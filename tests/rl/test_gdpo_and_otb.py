"""GDPO and the optimal token baseline in the RL loop: config keys, the inputs each estimator
declares reach it (reward components; old log-probs and sum_pi_squared from the trainer's
forward), and a real one-step run trains on the advantages the estimator gives for them."""

import math

import pytest
import torch

from tandem.algos import AdvantageConfig, AdvantageInput, compute_advantage
from tandem.protocol import group_ids_from_uids
from tandem.rl import RLTrainer, load_train_config
from tests.algos import reference as ref
from tests.rl.conftest import small_config

BASE = ["model_path=/m", "data.train_path=/d.parquet"]

COMPONENT_REWARD = (
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    digits = sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
    "    short = float(len(solution) <= 3)\n"
    "    return {'score': digits + short, 'digits': digits, 'short': short, 'note': 'x'}\n"
)


def test_config_keys_and_what_each_estimator_asks_the_trainer_for():
    gdpo = load_train_config(
        [
            *BASE,
            "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[digits,short]",
            "algorithm.gdpo_reward_weights=[1.0,0.5]",
        ]
    )
    assert gdpo.algorithm.reward_component_keys == ("digits", "short")
    assert gdpo.algorithm.advantage_config().gdpo_reward_weights == (1.0, 0.5)
    assert not gdpo.algorithm.needs_sum_pi_squared and gdpo.old_log_probs_from_update
    otb = load_train_config([*BASE, "algorithm.adv_estimator=optimal_token_baseline"])
    assert otb.algorithm.needs_sum_pi_squared and otb.algorithm.advantages_need_old_log_probs
    assert not otb.old_log_probs_from_update  # the estimator runs before the update: a separate forward
    assert load_train_config(BASE).algorithm.reward_component_keys == ()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "algorithm.adv_estimator=gdpo",
                "algorithm.gdpo_reward_keys=[a,b]",
                "algorithm.gdpo_reward_weights=[1.0]",
            ],
            r"algorithm.gdpo_reward_weights has 1 entries but algorithm.gdpo_reward_keys has 2",
        ),
        (
            ["algorithm.gdpo_reward_keys=[a]"],
            r"algorithm.gdpo_reward_keys=\['a'\] is set, but the estimator 'grpo' \(algorithm.adv_estimator\)",
        ),
        (
            [
                "algorithm.adv_estimator=optimal_token_baseline",
                "pipeline.mode=one_step_off",
                "pipeline.old_log_probs=rollout",
            ],
            "needs sum_pi_squared from a trainer forward, which pipeline.old_log_probs=rollout skips",
        ),
        (["actor.policy_loss.name=dro"], r"actor.policy_loss.dro_beta must be set \(> 0\)"),
    ],
)
def test_bad_combinations_name_the_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_train_config([*BASE, *overrides])


class RecordingTrainer(RLTrainer):
    """Keeps each step's batch as it leaves the advantage stage."""

    def compute_advantages(self, batch):
        batch, metrics = super().compute_advantages(batch)
        self.seen = batch
        return batch, metrics


def run_one_step(rl_files, tmp_path, *overrides) -> tuple[dict, object]:
    trainer = RecordingTrainer(
        small_config(rl_files, tmp_path, "trainer.total_steps=1", "data.val_path=", *overrides)
    )
    (metrics,) = trainer.fit().history
    assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
    return metrics, trainer.seen


def test_gdpo_trains_on_the_reward_components(rl_files, tmp_path):
    reward = tmp_path / "parts.py"
    reward.write_text(COMPONENT_REWARD)
    metrics, batch = run_one_step(
        rl_files,
        tmp_path / "run",
        f"reward.custom_path={reward}",
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[short,digits]",
        "algorithm.gdpo_reward_weights=[0.5,2.0]",
    )
    components = batch["reward_components"]
    assert components.shape == (16, 2)
    scores = batch["token_level_scores"].sum(-1)
    torch.testing.assert_close(components.sum(-1), scores)  # short + digits is the score
    assert metrics["reward/invalid_fields"] == 16  # 'note' is text: left out of the metrics, counted
    expected = ref.gdpo(
        components, batch["response_mask"], group_ids_from_uids(batch["uid"]), (0.5, 2.0), True, 1e-6
    )
    torch.testing.assert_close(batch["advantages"].double(), expected, atol=1e-5, rtol=1e-5)


def test_gdpo_names_the_missing_reward_field(rl_files, tmp_path):
    reward = tmp_path / "parts.py"
    reward.write_text(COMPONENT_REWARD)
    message = (
        r"has no field 'answer' \(algorithm.gdpo_reward_keys\); it returned the fields \['digits', 'note'"
    )
    with pytest.raises(ValueError, match=message):
        run_one_step(
            rl_files,
            tmp_path / "run",
            f"reward.custom_path={reward}",
            "algorithm.adv_estimator=gdpo",
            "algorithm.gdpo_reward_keys=[digits,answer]",
        )


def test_optimal_token_baseline_gets_sum_pi_squared_from_the_old_log_prob_forward(rl_files, tmp_path):
    metrics, batch = run_one_step(rl_files, tmp_path, "algorithm.adv_estimator=optimal_token_baseline")
    assert "timing_s/old_log_prob" in metrics  # a separate forward before the update
    mask = batch["response_mask"].bool()
    sum_pi_squared, old = batch["sum_pi_squared"], batch["old_log_probs"]
    # one forward gave both: each token's own probability squared is part of the sum, and the sum is at most 1
    assert (sum_pi_squared[mask] >= old[mask].exp().square() - 1e-6).all() and (
        sum_pi_squared[mask] <= 1 + 1e-6
    ).all()
    assert (sum_pi_squared[~mask] == 0).all()
    expected, _ = ref.optimal_token_baseline(
        batch["token_level_rewards"],
        batch["response_mask"],
        group_ids_from_uids(batch["uid"]),
        old,
        sum_pi_squared,
    )
    torch.testing.assert_close(batch["advantages"].double(), expected, atol=1e-5, rtol=1e-5)
    direct = compute_advantage(
        AdvantageInput(
            batch["token_level_rewards"],
            batch["response_mask"],
            group_ids_from_uids(batch["uid"]),
            old_log_probs=old,
            sum_pi_squared=sum_pi_squared,
        ),
        AdvantageConfig(estimator="optimal_token_baseline"),
    )
    torch.testing.assert_close(batch["advantages"], direct.advantages)


def test_dro_with_token_sum_and_an_abs_plus_kl_loss_trains(rl_files, tmp_path):
    """The new loss, aggregation mode and KL estimator through the real actor loss (their math is
    checked against references in tests/algos)."""
    metrics, _ = run_one_step(
        rl_files,
        tmp_path,
        "actor.policy_loss.name=dro",
        "actor.policy_loss.dro_beta=0.1",
        "actor.policy_loss.loss_agg_mode=token-sum",
        "algorithm.kl.use_kl_loss=true",
        "algorithm.kl.estimator=abs+",
        "actor.recompute_old_log_probs=true",
    )
    assert metrics["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-5)  # one update: old = current policy
    assert math.isfinite(metrics["actor/kl_loss"]) and metrics["actor/kl_loss"] >= 0


def test_optimal_token_baseline_on_two_workers_matches_one(rl_files, tmp_path):
    """sum_pi_squared from each DDP rank's shard gives the single worker's advantages and update."""
    histories = [
        RLTrainer(
            small_config(
                rl_files,
                tmp_path / f"w{workers}",
                "trainer.total_steps=1",
                "data.val_path=",
                "algorithm.adv_estimator=optimal_token_baseline",
                f"trainer.n_workers={workers}",
            )
        )
        .fit()
        .history
        for workers in (1, 2)
    ]
    (one,), (two,) = histories
    for name in ("critic/advantages/max", "critic/advantages/min", "critic/advantages/mean"):
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name
    for name in ("actor/pg_loss", "actor/grad_norm"):
        assert two[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6), name
