"""A translated verl command computes verl's numbers: for every verl policy loss, the tandem loss
built from the translated config equals verl's formula (value, gradient, every metric verl
reports) on inputs that exercise the deliberate differences (log-ratios beyond ±20, zero
advantages, rollout-correction weights). The formulas are tests/algos/verl_formulas.py."""

from __future__ import annotations

import pytest

from tandem.algos.policy_losses import PolicyLossConfig
from tandem.verl import translate
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
