"""Every advantage estimator against its per-sample loop reference."""

import pytest
import torch

from tandem.algos import ADVANTAGE_ESTIMATORS, AdvantageConfig, AdvantageInput, compute_advantage
from tests.algos import reference as ref

TOL = dict(atol=1e-9, rtol=1e-9)


def run(name: str, inputs: AdvantageInput, **config):
    return compute_advantage(inputs, AdvantageConfig(estimator=name, **config))


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_and_dr_grpo(rollout, norm_by_std):
    rewards, mask, groups = rollout
    out = run("grpo", AdvantageInput(rewards, mask, groups), norm_adv_by_std=norm_by_std)
    torch.testing.assert_close(out.advantages, ref.grpo(rewards, mask, groups, norm_by_std, 1e-6), **TOL)


def test_grpo_equal_rewards_give_zero_and_singletons_keep_raw_score():
    rewards = torch.tensor([[1.0], [1.0], [1.0], [0.5]], dtype=torch.float64)
    out = run("grpo", AdvantageInput(rewards, torch.ones(4, 1), torch.tensor([0, 0, 0, 1])))
    assert out.advantages[:3].abs().max() == 0
    assert out.advantages[3, 0] == 0.5
    assert torch.isfinite(out.advantages).all()


def test_rloo(rollout):
    rewards, mask, groups = rollout
    out = run("rloo", AdvantageInput(rewards, mask, groups))
    torch.testing.assert_close(out.advantages, ref.rloo(rewards, mask, groups), **TOL)


def test_opo(rollout):
    rewards, mask, groups = rollout
    out = run("opo", AdvantageInput(rewards, mask, groups))
    torch.testing.assert_close(out.advantages, ref.opo(rewards, mask, groups), **TOL)


def test_reinforce_plus_plus_baseline(rollout):
    rewards, mask, groups = rollout
    out = run("reinforce_plus_plus_baseline", AdvantageInput(rewards, mask, groups))
    torch.testing.assert_close(out.advantages, ref.reinforce_pp_baseline(rewards, mask, groups), **TOL)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_passk(norm_by_std):
    rewards, mask, groups = ref_rollout_without_singletons()
    out = run("grpo_passk", AdvantageInput(rewards, mask, groups), norm_adv_by_std=norm_by_std)
    torch.testing.assert_close(
        out.advantages, ref.grpo_passk(rewards, mask, groups, norm_by_std, 1e-6), **TOL
    )


def ref_rollout_without_singletons():
    from tests.algos.conftest import make_rollout

    rewards, mask, groups = make_rollout(3)
    keep = groups != 42
    return rewards[keep], mask[keep], groups[keep]


def test_grpo_passk_rejects_a_group_of_one():
    with pytest.raises(ValueError, match="at least 2 responses"):
        run("grpo_passk", AdvantageInput(torch.ones(3, 2), torch.ones(3, 2), torch.tensor([0, 0, 1])))


@pytest.mark.parametrize("f_norm", [1.0, 2.5])
def test_gpg(rollout, f_norm):
    rewards, mask, groups = rollout
    out = run("gpg", AdvantageInput(rewards, mask, groups), gpg_f_norm=f_norm)
    torch.testing.assert_close(out.advantages, ref.gpg(rewards, mask, groups, f_norm), **TOL)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(rollout, gamma):
    rewards, mask, _ = rollout
    rewards = rewards + torch.randn_like(rewards) * mask  # dense token rewards
    out = run("reinforce_plus_plus", AdvantageInput(rewards, mask), gamma=gamma)
    expected_adv, expected_ret = ref.reinforce_pp(rewards, mask, gamma)
    torch.testing.assert_close(out.advantages, expected_adv, **TOL)
    torch.testing.assert_close(out.returns, expected_ret, **TOL)


def test_remax(rollout):
    rewards, mask, _ = rollout
    baselines = torch.randn(rewards.shape[0], dtype=torch.float64)
    out = run("remax", AdvantageInput(rewards, mask, reward_baselines=baselines))
    torch.testing.assert_close(out.advantages, ref.remax(rewards, mask, baselines), **TOL)


@pytest.mark.parametrize("gamma,lam,whiten", [(1.0, 1.0, False), (0.99, 0.95, False), (0.9, 0.8, True)])
def test_gae_with_multi_turn_holes(rollout, gamma, lam, whiten):
    rewards, mask, _ = rollout
    gen = torch.Generator().manual_seed(5)
    holes = torch.rand(mask.shape, generator=gen) < 0.3  # tool-output tokens inside responses
    mask = mask * (~holes).long()
    rewards = torch.randn(rewards.shape, generator=gen, dtype=torch.float64)
    values = torch.randn(rewards.shape, generator=gen, dtype=torch.float64)
    out = run("gae", AdvantageInput(rewards, mask, values=values), gamma=gamma, lam=lam, whiten_gae=whiten)
    expected_adv, expected_ret = ref.gae(rewards, values, mask, gamma, lam, whiten)
    torch.testing.assert_close(out.advantages, expected_adv, **TOL)
    torch.testing.assert_close(out.returns, expected_ret, **TOL)


@pytest.mark.parametrize("name", ADVANTAGE_ESTIMATORS.names())
def test_every_estimator_is_finite_and_zero_outside_the_mask(rollout, name):
    rewards, mask, groups = rollout
    if name == "grpo_passk":
        rewards, mask, groups = ref_rollout_without_singletons()
    inputs = AdvantageInput(
        rewards,
        mask,
        groups,
        values=torch.randn_like(rewards),
        reward_baselines=torch.randn(rewards.shape[0], dtype=rewards.dtype),
        reward_components=torch.randn(rewards.shape[0], 2, dtype=rewards.dtype),
        old_log_probs=-torch.rand_like(rewards) * 3,
        sum_pi_squared=torch.rand_like(rewards),
    )
    out = run(name, inputs)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()
    assert (out.advantages[mask == 0] == 0).all()


def components_of(rollout, count=3, seed=0):
    rewards, _, groups = rollout
    gen = torch.Generator().manual_seed(seed)
    components = torch.randint(0, 3, (rewards.shape[0], count), generator=gen).to(rewards.dtype)
    components[:, 0] = rewards.sum(-1)  # one component equal to the score
    components[groups == 5, 1] = 2.0  # a component with no spread in one group
    return components


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("weights", [(), (1.0, 0.5, 2.0)])
def test_gdpo_normalises_each_component_within_groups(rollout, norm_by_std, weights):
    rewards, mask, groups = rollout
    components = components_of(rollout)
    keys = ("score", "format", "length")
    out = run(
        "gdpo",
        AdvantageInput(rewards, mask, groups, reward_components=components),
        norm_adv_by_std=norm_by_std,
        gdpo_reward_keys=keys,
        gdpo_reward_weights=weights,
    )
    expected = ref.gdpo(components, mask, groups, weights or (1.0,) * 3, norm_by_std, 1e-6)
    torch.testing.assert_close(out.advantages, expected, **TOL)


def test_gdpo_without_components_is_grpo_then_whitening(rollout):
    rewards, mask, groups = rollout
    out = run("gdpo", AdvantageInput(rewards, mask, groups))
    expected = ref.whiten_valid(ref.grpo(rewards, mask, groups, True, 1e-6), mask)
    torch.testing.assert_close(out.advantages, expected, **TOL)


def otb_inputs(rollout, seed=0, with_weights=False):
    rewards, mask, groups = rollout
    gen = torch.Generator().manual_seed(seed)
    rewards = rewards + torch.randn(rewards.shape, generator=gen, dtype=rewards.dtype) * mask  # dense rewards
    old_log_probs = -torch.rand(rewards.shape, generator=gen, dtype=rewards.dtype) * 3
    sum_pi_squared = torch.rand(rewards.shape, generator=gen, dtype=rewards.dtype)
    weights = torch.rand(rewards.shape, generator=gen, dtype=rewards.dtype) * 2 if with_weights else None
    return AdvantageInput(
        rewards,
        mask,
        groups,
        old_log_probs=old_log_probs,
        sum_pi_squared=sum_pi_squared,
        rollout_is_weights=weights,
    )


@pytest.mark.parametrize("with_weights", [False, True])
def test_optimal_token_baseline(rollout, with_weights):
    inputs = otb_inputs(rollout, with_weights=with_weights)
    out = run("optimal_token_baseline", inputs)
    expected_adv, expected_ret = ref.optimal_token_baseline(
        inputs.token_level_rewards, inputs.response_mask, inputs.group_ids,
        inputs.old_log_probs, inputs.sum_pi_squared, inputs.rollout_is_weights,
    )  # fmt: skip
    torch.testing.assert_close(out.advantages, expected_adv, **TOL)
    torch.testing.assert_close(out.returns, expected_ret, **TOL)


def test_optimal_token_baseline_zeroes_the_baseline_past_the_second_longest():
    rewards = torch.tensor(
        [[0.0, 0.0, 0.0, 1.0], [0.0, 2.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64
    )
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    ones = torch.ones_like(rewards)
    inputs = AdvantageInput(
        rewards, mask, torch.zeros(3, dtype=torch.long), old_log_probs=-ones, sum_pi_squared=ones * 0.5
    )
    out = run("optimal_token_baseline", inputs)
    torch.testing.assert_close(
        out.advantages[0, 2:], out.returns[0, 2:]
    )  # the longest one's tail: no baseline
    assert (out.advantages[0, :2] != out.returns[0, :2]).all()


def test_missing_inputs_and_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="'gae' needs \\['values'\\]"):
        run("gae", AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="'grpo' needs \\['group_ids'\\]"):
        run("grpo", AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="response_mask has shape"):
        AdvantageInput(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="group_ids has shape"):
        AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3, dtype=torch.long))
    with pytest.raises(
        ValueError, match="'optimal_token_baseline' needs \\['old_log_probs', 'sum_pi_squared'\\]"
    ):
        run("optimal_token_baseline", AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)))
    with pytest.raises(
        ValueError, match=r"gdpo needs reward_components \[B, 2\] for algorithm.gdpo_reward_keys"
    ):
        run(
            "gdpo",
            AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2)),
            gdpo_reward_keys=("a", "b"),
        )
    with pytest.raises(ValueError, match=r"reward_components has shape \(3, 2\), expected \(2, K\)"):
        AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3), reward_components=torch.zeros(3, 2))
    with pytest.raises(ValueError, match="sum_pi_squared has shape"):
        AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3), sum_pi_squared=torch.zeros(2, 4))
