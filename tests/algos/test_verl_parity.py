"""With the settings docs/algorithms.md lists, tandem computes verl's numbers: each policy loss's value,
gradient and every metric verl reports, the KL estimators, aggregation, GDPO and OTB, against
verl 0.9.1's formulas re-derived in ``verl_formulas.py``; where docs/algorithms.md lists a difference
with no setting (GPG's alpha, OTB's ``handle_zero_tail=False``), the test pins its exact size."""

import dataclasses

import numpy as np
import pytest
import torch

from tandem.algos import (
    LOSS_AGG_MODES,
    AdvantageConfig,
    AdvantageInput,
    PolicyLossConfig,
    PolicyLossInput,
    aggregate_loss,
    compute_advantage,
    compute_policy_loss,
    kl_estimate,
)
from tests.algos import verl_formulas as verl
from tests.algos.conftest import make_rollout


@dataclasses.dataclass(frozen=True)
class Case:
    """A verl loss, the tandem config that reproduces it, and where verl's metrics live in tandem's."""

    formula: object
    tandem: dict
    formula_kwargs: dict = dataclasses.field(default_factory=dict)
    metric_names: dict = dataclasses.field(default_factory=dict)  # verl name -> tandem name
    constant_zero: tuple = ()  # metrics verl always reports as 0 and tandem leaves out


CASES = {
    "vanilla": Case(verl.vanilla, dict(name="ppo")),
    "dppo_tv": Case(
        verl.dppo_tv, dict(name="dppo_tv", dppo_ratio_cap=3.0, dppo_zero_advantage_region="negative")
    ),
    "dppo_kl": Case(
        verl.dppo_kl, dict(name="dppo_kl", dppo_ratio_cap=3.0, dppo_zero_advantage_region="negative")
    ),
    "gspo": Case(
        verl.gspo,
        dict(
            name="gspo",
            clip_ratio_low=3e-4,
            clip_ratio_high=4e-4,
            log_ratio_clamp=None,
        ),
        constant_zero=("pg_clipfrac_lower",),
    ),
    "sapo": Case(
        verl.sapo,
        dict(name="sapo", pg_loss_agg_mode="seq-mean-token-mean"),
        constant_zero=("pg_clipfrac", "pg_clipfrac_lower"),
    ),
    "gpg": Case(verl.gpg, dict(name="gpg")),
    "clip_cov": Case(  # every eligible token is detached (k covers them): no random choice to match
        verl.clip_cov,
        dict(name="clip_cov", clip_cov_ratio=1.0, clip_cov_lb=-0.05, clip_cov_ub=0.05, log_ratio_clamp=None),
        dict(ratio_k=1.0, lb=-0.05, ub=0.05),
    ),
    "kl_cov": Case(
        verl.kl_cov,
        dict(name="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=0.1, log_ratio_clamp=None),
        dict(ratio_k=0.1, coef=0.1),
        metric_names={"ppo_kl": "ppo_kl_abs"},
    ),
    "geo_mean": Case(
        verl.geo_mean,
        dict(name="gmpo", log_ratio_clamp=None, gmpo_is_weight_mean="geometric"),
        dict(low=0.2, high=0.2),
    ),
    "dro": Case(verl.dro, dict(name="dro", dro_beta=0.5), dict(beta=0.5)),
    "cispo": Case(verl.cispo, dict(name="cispo"), constant_zero=("pg_clipfrac_lower",)),
}


def make_inputs(seed, variant, batch=6, length=7):
    """Log-probs near a behaviour policy; ``variant`` adds log-ratios beyond ±20, zero advantages,
    an empty row, or rollout-correction weights."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3 - 0.05
    shift = torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.3
    if variant == "extreme":
        shift[0, :2] = torch.tensor([25.0, -30.0])
        shift[2, 0] = 4.0
    log_probs = (old + shift).clamp(max=-1e-3)
    advantages = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    if variant == "zero_advantages":
        advantages[:, 1::2] = 0.0
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    if variant == "empty_row":
        lengths[1] = 0
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()
    weights = None
    if variant == "weights":
        weights = torch.rand(batch, length, generator=gen, dtype=torch.float64) * 2
    return log_probs, old, advantages, mask, weights


def loss_grad_metrics(run, log_probs):
    log_probs = log_probs.clone().requires_grad_(True)
    loss, metrics = run(log_probs)
    (grad,) = torch.autograd.grad(loss, log_probs, allow_unused=True)
    return loss.detach(), torch.zeros_like(log_probs) if grad is None else grad, metrics


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("variant", ["plain", "extreme", "zero_advantages", "empty_row", "weights"])
def test_policy_losses_reproduce_verl(name, mode, variant):
    case = CASES[name]
    if name == "geo_mean" and variant == "empty_row":
        pytest.skip("verl's geo_mean averages over all rows of a micro-batch, empty ones too (see the docs)")
    config = PolicyLossConfig(loss_agg_mode=mode, **case.tandem)
    assert_loss_matches_verl(case, config, mode, *make_inputs(3, variant))


def assert_loss_matches_verl(case, config, mode, log_probs, old, adv, mask, weights):
    """tandem's loss under ``config`` equals ``case``'s verl formula: value, gradient, every metric verl
    reports (those it always reports as 0 aside)."""
    ours = loss_grad_metrics(
        lambda lp: (
            (out := compute_policy_loss(PolicyLossInput(lp, old, adv, mask, weights), config)).loss,
            out.metrics,
        ),
        log_probs,
    )
    theirs = loss_grad_metrics(
        lambda lp: case.formula(old, lp, adv, mask.double(), mode, weights=weights, **case.formula_kwargs),
        log_probs,
    )
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-7, atol=1e-9)
    for verl_name, value in theirs[2].items():
        if verl_name in case.constant_zero:
            assert float(value) == 0.0
            continue
        tandem_value = ours[2][case.metric_names.get(verl_name, verl_name)]
        torch.testing.assert_close(tandem_value, value.to(tandem_value.dtype), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("verl_name", ["k1", "abs", "k2", "k3", "k1+", "abs+", "k2+", "k3+"])
def test_kl_estimators_reproduce_verl(verl_name):
    gen = torch.Generator().manual_seed(0)
    log_probs = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4
    ref = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4
    ref[0, 0] = log_probs[0, 0] - 25.0  # the k3 clamps
    tandem_name = "k2" if verl_name == "k2+" else verl_name  # k2 is its own straight-through variant
    ours = loss_grad_metrics(lambda lp: (kl_estimate(lp, ref, tandem_name).sum(), {}), log_probs)
    theirs = loss_grad_metrics(lambda lp: (verl.kl_penalty(lp, ref, verl_name).sum(), {}), log_probs)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_reproduces_verl(mode):
    gen = torch.Generator().manual_seed(1)
    loss = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).long()
    mask[2] = 0
    torch.testing.assert_close(aggregate_loss(loss, mask, mode), verl.aggregate(loss, mask, mode))


def uid_index(group_ids):
    return np.array([f"uid-{g}" for g in group_ids.tolist()], dtype=object)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("weights", [(), (1.0, 0.5)])
def test_gdpo_reproduces_verl(seed, norm_by_std, weights):
    rewards, mask, groups = make_rollout(seed)
    gen = torch.Generator().manual_seed(seed)
    components = torch.randint(0, 3, (rewards.shape[0], 2), generator=gen).double()
    out = compute_advantage(
        AdvantageInput(rewards, mask, groups, reward_components=components),
        AdvantageConfig(
            estimator="gdpo",
            norm_adv_by_std=norm_by_std,
            gdpo_reward_keys=("format", "answer"),
            gdpo_reward_weights=weights,
        ),
    )
    expected = verl.gdpo(components, mask.double(), uid_index(groups), list(weights) or None, norm_by_std)
    # verl divides a group of one by 1 + eps (its std stand-in is 1); tandem leaves its score as is
    torch.testing.assert_close(out.advantages, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("with_weights", [False, True])
def test_optimal_token_baseline_reproduces_verl(seed, with_weights):
    rewards, mask, groups = make_rollout(seed)
    gen = torch.Generator().manual_seed(seed)
    rewards = rewards + torch.randn(rewards.shape, generator=gen, dtype=rewards.dtype) * mask
    old = -torch.rand(rewards.shape, generator=gen, dtype=rewards.dtype) * 3
    sum_pi_squared = torch.rand(rewards.shape, generator=gen, dtype=rewards.dtype)
    weights = torch.rand(rewards.shape, generator=gen, dtype=rewards.dtype) * 2 if with_weights else None
    out = compute_advantage(
        AdvantageInput(
            rewards,
            mask,
            groups,
            old_log_probs=old,
            sum_pi_squared=sum_pi_squared,
            rollout_is_weights=weights,
        ),
        AdvantageConfig(estimator="optimal_token_baseline"),
    )
    advantages, returns = verl.optimal_token_baseline(
        rewards, mask.double(), uid_index(groups), old, sum_pi_squared, weights
    )
    torch.testing.assert_close(out.advantages, advantages)
    torch.testing.assert_close(out.returns, returns)


def test_gpg_differs_from_verl_by_alpha_alone():
    """tandem's alpha is B / (B - M) (the paper's, M = responses in zero-spread groups); verl's is
    B / (number of non-zero scores): the advantages differ by that ratio and nothing else."""
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 0.5, -1.5], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 4, 4])  # 1 and 2 have no spread, 3 is alone
    mask = torch.ones(len(scores), 3, dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    rewards[:, -1] = scores
    out = compute_advantage(AdvantageInput(rewards, mask, groups), AdvantageConfig(estimator="gpg"))
    expected = verl.gpg_advantage(scores, uid_index(groups)).unsqueeze(-1) * mask
    tandem_alpha, verl_alpha = 12 / (12 - 5), 12 / 8  # M = 5; 8 non-zero scores
    torch.testing.assert_close(out.advantages * (verl_alpha / tandem_alpha), expected)


def test_optimal_token_baseline_zeroes_the_tail_as_verl_s_trainer_does():
    """verl's trainer calls OTB with ``handle_zero_tail=True`` (its default), as tandem always does;
    ``False`` (reachable only by calling verl's function) keeps the group baseline on the tail of a
    group's sole longest response, past the second-longest length, and changes nothing else."""
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    rewards = torch.zeros_like(mask)
    rewards[0, 4], rewards[1, 1], rewards[2, 0] = 1.0, 0.5, -1.0
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(mask.shape, generator=gen, dtype=torch.float64) * 2
    sum_pi_squared = torch.rand(mask.shape, generator=gen, dtype=torch.float64)
    groups = torch.tensor([0, 0, 0])
    out = compute_advantage(
        AdvantageInput(rewards, mask, groups, old_log_probs=old, sum_pi_squared=sum_pi_squared),
        AdvantageConfig(estimator="optimal_token_baseline"),
    )
    index = uid_index(groups)
    zeroed, _ = verl.optimal_token_baseline(rewards, mask, index, old, sum_pi_squared)
    kept, _ = verl.optimal_token_baseline(rewards, mask, index, old, sum_pi_squared, handle_zero_tail=False)
    torch.testing.assert_close(out.advantages, zeroed)
    tail = torch.zeros_like(mask, dtype=torch.bool)
    tail[0, 2:] = True  # the sole longest response (5 tokens) past the second-longest (2)
    assert torch.equal(zeroed != kept, tail)
