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
    )
    out = run(name, inputs)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.returns).all()
    assert (out.advantages[mask == 0] == 0).all()


def test_missing_inputs_and_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="'gae' needs \\['values'\\]"):
        run("gae", AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="'grpo' needs \\['group_ids'\\]"):
        run("grpo", AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3)))
    with pytest.raises(ValueError, match="response_mask has shape"):
        AdvantageInput(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="group_ids has shape"):
        AdvantageInput(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(3, dtype=torch.long))
