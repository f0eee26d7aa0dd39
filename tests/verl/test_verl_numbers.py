"""A translated verl command computes verl's numbers: for every verl policy loss, the tandem loss
built from the translated config equals verl's formula (value, gradient, every metric verl
reports) on inputs that exercise the deliberate differences (log-ratios beyond ±20, zero
advantages, rollout-correction weights); GSPO under every aggregation mode; RLOO's groups of one.
The formulas are tests/algos/verl_formulas.py (verl 0.9.1)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from tandem.algos import (
    LOSS_AGG_MODES,
    AdvantageConfig,
    AdvantageInput,
    PolicyLossConfig,
    PolicyLossInput,
    compute_advantage,
    compute_policy_loss,
)
from tandem.verl import translate
from tandem.verl.joint_algorithm import VERL_LOSS_BEHAVIOUR, VERL_VERSION
from tests.algos import verl_formulas as verl
from tests.algos.test_verl_parity import CASES, assert_loss_matches_verl, make_inputs
from tests.verl.test_translate import args

# verl keys for the knobs each formula is called with (its keyword -> verl's key).
VERL_KEYS = {
    "ratio_k": {
        "clip_cov": "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
        "kl_cov": "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
    },
    "coef": {"kl_cov": "actor_rollout_ref.actor.policy_loss.ppo_kl_coef"},
    "lb": {"clip_cov": "actor_rollout_ref.actor.policy_loss.clip_cov_lb"},
    "ub": {"clip_cov": "actor_rollout_ref.actor.policy_loss.clip_cov_ub"},
    "beta": {"dro": "actor_rollout_ref.actor.policy_loss.dro_beta"},
    "low": {"geo_mean": "actor_rollout_ref.actor.clip_ratio_low"},
    "high": {"geo_mean": "actor_rollout_ref.actor.clip_ratio_high"},
}
CLIPS = {"gspo": (3e-4, 4e-4)}  # the formula's own defaults, given to verl as clip_ratio_low/high


@functools.cache  # a translation takes about a second; the config is frozen
def translated_loss_config(verl_name: str, mode: str) -> PolicyLossConfig:
    case = CASES[verl_name]
    items = [
        f"actor_rollout_ref.actor.policy_loss.loss_mode={verl_name}",
        f"actor_rollout_ref.actor.loss_agg_mode={mode}",
    ]
    for keyword, value in case.formula_kwargs.items():
        items.append(f"{VERL_KEYS[keyword][verl_name]}={value}")
    if verl_name in CLIPS:
        low, high = CLIPS[verl_name]
        items += [
            f"actor_rollout_ref.actor.clip_ratio_low={low}",
            f"actor_rollout_ref.actor.clip_ratio_high={high}",
        ]
    return translate(args(*items)).config().actor.policy_loss


@pytest.mark.parametrize("verl_name", sorted(CASES))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("variant", ["extreme", "zero_advantages", "weights"])
def test_translated_losses_compute_verl_s_numbers(verl_name, mode, variant):
    config = translated_loss_config(verl_name, mode)
    assert_loss_matches_verl(CASES[verl_name], config, mode, *make_inputs(5, variant))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("variant", ["plain", "extreme", "empty_row", "weights"])
def test_translated_gspo_aggregates_by_loss_agg_mode_as_verl_0_9_1(mode, variant):
    """verl 0.9.1's GSPO aggregates its policy term by ``loss_agg_mode`` (up to 0.9.0 it forced
    seq-mean-token-mean)."""
    config = translated_loss_config("gspo", mode)
    assert_loss_matches_verl(CASES["gspo"], config, mode, *make_inputs(11, variant))


def test_translated_gspo_token_mean_averages_over_tokens():
    """On policy every ratio is 1: token-mean is (-1 + 1 + 1) / 3 over the three valid tokens, where a
    per-sequence mean would give (-1 + 1) / 2 = 0."""
    log_probs = torch.tensor([[-1.0, -7.0], [-1.0, -1.0]], dtype=torch.float64)  # -7: padding
    mask = torch.tensor([[1, 0], [1, 1]])
    advantages = torch.tensor([[1.0, 5.0], [-1.0, -1.0]], dtype=torch.float64)
    config = translated_loss_config("gspo", "token-mean")
    out = compute_policy_loss(PolicyLossInput(log_probs, log_probs.clone(), advantages, mask), config)
    assert float(out.loss) == pytest.approx(1 / 3)
    theirs, _ = verl.gspo(log_probs, log_probs.clone(), advantages, mask.double(), "token-mean")
    assert float(theirs) == pytest.approx(1 / 3)


def _outcome_rollout(scores, lengths, width=4):
    """``(rewards [B, R], mask [B, R])``: each score on its response's last token."""
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).double()
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(scores)), torch.tensor(lengths) - 1] = torch.tensor(scores, dtype=torch.float64)
    return rewards, mask


def _translated(estimator, n):
    return translate(args(f"algorithm.adv_estimator={estimator}", f"actor_rollout_ref.rollout.n={n}"))


def test_translated_rloo_vectorized_matches_verl_s_for_groups_of_several():
    rewards, mask = _outcome_rollout([1.0, 0.0, 2.5, -1.0, 0.5, 0.5], [4, 2, 3, 1, 4, 2])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    config = _translated("rloo_vectorized", 3).config().algorithm.advantage_config()
    out = compute_advantage(AdvantageInput(rewards, mask, groups), config)
    expected = verl.rloo_vectorized(rewards.sum(-1), groups.numpy()).unsqueeze(-1) * mask
    torch.testing.assert_close(out.advantages, expected)


@pytest.mark.parametrize("estimator", ["rloo", "rloo_vectorized"])
def test_a_group_of_one_is_where_verl_s_two_rloos_differ_and_tandem_refuses_it(estimator):
    """One response per prompt: verl's loop RLOO keeps the raw score (as tandem's ``rloo`` does), its
    vectorized RLOO gives 0. Both translate to tandem's ``rloo``; a run with rollout.n=1 is refused,
    naming verl's key, so no translated run meets a group of one."""
    rewards, mask = _outcome_rollout([1.0, 0.0, 2.5, -1.0], [4, 2, 3, 1])
    scores, groups = rewards.sum(-1), torch.arange(4)
    translation = _translated(estimator, 1)
    assert "algorithm.adv_estimator=rloo" in translation.overrides
    out = compute_advantage(AdvantageInput(rewards, mask, groups), AdvantageConfig(estimator="rloo"))
    torch.testing.assert_close(out.advantages, verl.rloo(scores, groups.numpy()).unsqueeze(-1) * mask)
    assert torch.equal(verl.rloo_vectorized(scores, groups.numpy()), torch.zeros(4))
    with pytest.raises(ValueError, match=r"rollout.n must be at least 2.*actor_rollout_ref.rollout.n"):
        translation.config()


def test_every_verl_behaviour_was_checked_against_the_release_the_docs_name():
    docs = (Path(__file__).parents[2] / "docs" / "migrating-from-verl.md").read_text()
    assert f"**verl {VERL_VERSION}**" in docs
    for name, behaviour in VERL_LOSS_BEHAVIOUR.items():
        assert behaviour.verl == VERL_VERSION, name
        assert all(f"{setting}=" in docs for setting in behaviour.settings), name
