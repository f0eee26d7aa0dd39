"""Registries refuse duplicates and unknown names; configs name the bad field."""

import pytest

from tandem.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageConfig,
    KLConfig,
    PolicyLossConfig,
)
from tandem.registry import Registry


def test_duplicate_names_are_errors():
    with pytest.raises(ValueError, match="policy loss 'ppo' is already registered"):
        POLICY_LOSSES.register("ppo")(lambda inputs, config: None)
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        ADVANTAGE_ESTIMATORS.register("grpo")(lambda inputs, config: None)


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown policy loss 'vanila'; registered: \[.*'ppo'"):
        POLICY_LOSSES.get("vanila")
    registry = Registry("thing")
    registry.register("a")(print)
    assert "a" in registry and registry.names() == ["a"] and list(registry) == ["a"]


def test_everything_the_issue_asks_for_is_registered():
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {
        "gae",
        "grpo",
        "rloo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "remax",
        "opo",
        "grpo_passk",
        "gpg",
        "gdpo",
        "optimal_token_baseline",
    }
    assert set(POLICY_LOSSES.names()) >= {
        "ppo",
        "gspo",
        "cispo",
        "sapo",
        "clip_cov",
        "kl_cov",
        "gpg",
        "gmpo",
        "dppo_tv",
        "dppo_kl",
        "dro",
    }
    assert set(KL_ESTIMATORS.names()) >= {"k1", "k2", "k3", "abs", "k1+", "k3+", "abs+"}


@pytest.mark.parametrize(
    "factory,message",
    [
        (lambda: AdvantageConfig(estimator="grpoo"), "algorithm.estimator='grpoo' is not registered"),
        (
            lambda: AdvantageConfig(gamma=1.5),
            r"algorithm.gamma=1.5 is outside the allowed range \[0.0, 1.0\]",
        ),
        (lambda: AdvantageConfig(epsilon=0), "algorithm.epsilon=0"),
        (lambda: PolicyLossConfig(name="ppo2"), "actor.policy_loss.name='ppo2' is not registered"),
        (
            lambda: PolicyLossConfig(loss_agg_mode="mean"),
            "actor.policy_loss.loss_agg_mode='mean' is not allowed",
        ),
        (lambda: PolicyLossConfig(clip_ratio_c=0.5), "actor.policy_loss.clip_ratio_c=0.5"),
        (lambda: PolicyLossConfig(clip_ratio_low=-0.1), "actor.policy_loss.clip_ratio_low=-0.1"),
        (
            lambda: PolicyLossConfig(clip_cov_lb=6.0),
            "actor.policy_loss.clip_cov_lb=6.0 must be below clip_cov_ub=5.0",
        ),
        (lambda: KLConfig(estimator="k4"), "algorithm.kl.estimator='k4' is not registered"),
        (
            lambda: PolicyLossConfig(name="dro"),
            r"actor.policy_loss.dro_beta must be set \(> 0\) when actor.policy_loss.name=dro",
        ),
        (lambda: PolicyLossConfig(name="dro", dro_beta=0.0), "actor.policy_loss.dro_beta=0.0 is outside"),
        (
            lambda: PolicyLossConfig(pg_loss_agg_mode="seq-sum"),
            "actor.policy_loss.pg_loss_agg_mode='seq-sum' is not allowed",
        ),
        (lambda: PolicyLossConfig(log_ratio_clamp=0.0), "actor.policy_loss.log_ratio_clamp=0.0"),
        (
            lambda: PolicyLossConfig(gmpo_is_weight_mean="harmonic"),
            "actor.policy_loss.gmpo_is_weight_mean='harmonic' is not allowed",
        ),
        (
            lambda: PolicyLossConfig(dppo_zero_advantage_region="positive"),
            "actor.policy_loss.dppo_zero_advantage_region='positive' is not allowed",
        ),
        (
            lambda: AdvantageConfig(
                estimator="gdpo", gdpo_reward_keys=("a", "b"), gdpo_reward_weights=(1.0,)
            ),
            r"algorithm.gdpo_reward_weights has 1 entries but algorithm.gdpo_reward_keys has 2",
        ),
        (
            lambda: AdvantageConfig(estimator="gdpo", gdpo_reward_keys=("a", "a")),
            "algorithm.gdpo_reward_keys=\\['a', 'a'\\] must be distinct",
        ),
        (
            lambda: AdvantageConfig(estimator="grpo", gdpo_reward_keys=("a",)),
            "algorithm.gdpo_reward_keys=\\['a'\\] is set, but the estimator 'grpo' \\(algorithm.adv_estimator\\) does not read",
        ),
        (lambda: KLConfig(controller="pid"), "algorithm.kl.controller='pid'"),
    ],
)
def test_config_validation_names_the_field(factory, message):
    with pytest.raises(ValueError, match=message):
        factory()


def test_an_alias_names_the_same_function_and_configs_store_the_registered_name(caplog):
    """verl's names are aliases in tandem's own config: the config keeps tandem's name, computes
    with the same function, and a note on ``tandem.names`` says what tandem calls it."""
    assert KL_ESTIMATORS.get("low_var_kl") is KL_ESTIMATORS.get("k3")
    assert POLICY_LOSSES.get("vanilla") is POLICY_LOSSES.get("ppo")
    with caplog.at_level("INFO", logger="tandem.names"):
        assert KLConfig(estimator="low_var_kl").estimator == "k3"
        assert PolicyLossConfig(name="geo_mean").name == "gmpo"
        assert AdvantageConfig(estimator="grpo_vectorized").estimator == "grpo"
        assert KLConfig(estimator="k3").estimator == "k3"  # a registered name: no note
    assert caplog.messages == [
        "algorithm.kl.estimator=low_var_kl: tandem calls this KL estimator 'k3'",
        "actor.policy_loss.name=geo_mean: tandem calls this policy loss 'gmpo'",
        "algorithm.estimator=grpo_vectorized: tandem calls this advantage estimator 'grpo'",
    ]
    assert "low_var_kl" not in KL_ESTIMATORS.names() and KL_ESTIMATORS.aliases()["low_var_kl"] == "k3"


def test_aliases_cannot_shadow_a_name_or_point_nowhere():
    registry = Registry("thing")
    registry.register("a", aliases=("b",))(print)
    with pytest.raises(ValueError, match="thing 'b' is already registered"):
        registry.register("b")(print)
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.add_alias("a", "a")
    with pytest.raises(ValueError, match="'z' is not registered"):
        registry.add_alias("c", "z")
    with pytest.raises(
        ValueError, match=r"x.key='q' is not registered; choose one of \['a'\] \(aliases: \['b'\]\)"
    ):
        registry.canonical("q", "x.key")
