"""KL estimators, penalties, controllers and the value loss against their formulas."""

import math

import pytest
import torch

from tandem.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLConfig,
    apply_kl_penalty,
    build_kl_controller,
    compute_entropy_term,
    compute_kl_loss,
    compute_value_loss,
    kl_estimate,
)
from tests.algos import reference as ref

FORMULAS = {
    "k1": lambda lp, r: lp - r,
    "abs": lambda lp, r: abs(lp - r),
    "k2": lambda lp, r: 0.5 * (lp - r) ** 2,
    "k3": lambda lp, r: min(max(math.exp(r - lp) - 1 - (r - lp), -10.0), 10.0),
}
FORMULAS["k1+"] = FORMULAS["k1"]
FORMULAS["k3+"] = FORMULAS["k3"]
FORMULAS["abs+"] = FORMULAS["abs"]


def log_probs_pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4).requires_grad_(True)
    ref_lp = -torch.rand(4, 5, generator=gen, dtype=torch.float64) * 4
    ref_lp[0, 0] = lp[0, 0].detach() - 15.0  # k3 value clamp territory
    return lp, ref_lp


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_estimator_values_match_formulas(name):
    lp, ref_lp = log_probs_pair()
    out = kl_estimate(lp, ref_lp, name)
    lp_values = lp.detach()
    expected = torch.tensor(
        [[FORMULAS[name](float(lp_values[i, t]), float(ref_lp[i, t])) for t in range(5)] for i in range(4)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("name", ["k1+", "k3+", "abs+"])
def test_straight_through_estimators_carry_the_k2_gradient(name):
    lp, ref_lp = log_probs_pair(1)
    (grad,) = torch.autograd.grad(kl_estimate(lp, ref_lp, name).sum(), lp)
    torch.testing.assert_close(grad, (lp - ref_lp).detach())  # d/dlp of (lp - ref)^2 / 2


def test_k3_is_unbiased_for_kl_under_sampling():
    """Monte Carlo check: E_{a~pi}[k3] equals the exact KL(pi || pi_ref) on a small vocabulary."""
    gen = torch.Generator().manual_seed(0)
    pi = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    pi_ref = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    exact = float((pi * (pi.log() - pi_ref.log())).sum())
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=gen)
    for name in ("k1", "k3"):
        estimate = float(kl_estimate(pi.log()[samples], pi_ref.log()[samples], name).mean())
        assert abs(estimate - exact) < 0.01, (name, estimate, exact)


def test_kl_penalty_on_rewards():
    lp, ref_lp = log_probs_pair(2)
    scores = torch.zeros(4, 5, dtype=torch.float64)
    scores[:, -1] = 1.0
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[1, 3:] = 0
    rewards, metrics = apply_kl_penalty(scores, lp.detach(), ref_lp, mask, coef=0.1, estimator="k1")
    lp = lp.detach()
    for i in range(4):
        for t in range(5):
            expected = float(scores[i, t]) - (
                0.1 * (float(lp[i, t]) - float(ref_lp[i, t])) if mask[i, t] else 0.0
            )
            assert math.isclose(float(rewards[i, t]), expected, abs_tol=1e-12)
    per_seq = [
        ref.mean([float(lp[i, t] - ref_lp[i, t]) for t in ref.valid_positions(mask[i])]) for i in range(4)
    ]
    assert math.isclose(float(metrics["kl"]), ref.mean(per_seq), abs_tol=1e-12)


def test_abs_plus_differs_from_abs_only_in_its_gradient():
    lp, ref_lp = log_probs_pair(4)
    plain, straight = kl_estimate(lp, ref_lp, "abs"), kl_estimate(lp, ref_lp, "abs+")
    torch.testing.assert_close(straight, plain)
    (plain_grad,) = torch.autograd.grad(plain.sum(), lp)
    torch.testing.assert_close(plain_grad, torch.sign(lp - ref_lp).detach())  # |l|' is the sign
    (straight_grad,) = torch.autograd.grad(straight.sum(), lp)
    torch.testing.assert_close(straight_grad, (lp - ref_lp).detach())


def test_kl_loss_aggregates_like_policy_loss():
    lp, ref_lp = log_probs_pair(3)
    mask = torch.ones(4, 5, dtype=torch.long)
    loss = compute_kl_loss(lp, ref_lp, mask, "k2", "token-mean")
    torch.testing.assert_close(loss, (0.5 * (lp - ref_lp) ** 2).mean())


def test_adaptive_controller_follows_ziegler_update():
    ctrl = build_kl_controller(KLConfig(controller="adaptive", coef=0.2, target_kl=0.1, horizon=100))
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.5, n_steps=10)  # error clipped to +0.2
    assert math.isclose(ctrl.value, 0.2 * (1 + 0.2 * 10 / 100))
    ctrl.update(current_kl=0.09, n_steps=10)  # error -0.1
    assert math.isclose(ctrl.value, 0.2 * 1.02 * (1 - 0.1 * 10 / 100))
    fixed = build_kl_controller(KLConfig(coef=0.3))
    fixed.update(5.0, 10)
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.3


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_matches_loop(clip, mode):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    returns = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    old = values.detach() + torch.randn(3, 4, generator=gen, dtype=torch.float64) * 0.5
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    loss, metrics = compute_value_loss(values, returns, old, mask, clip, mode)
    terms, clipped = {}, 0
    for i in range(3):
        for t in ref.valid_positions(mask[i]):
            v, g, o = values[i, t], float(returns[i, t]), float(old[i, t])
            err = (v - g) ** 2
            if clip is not None:
                vc = o + ref.clamp(v - o, -clip, clip)
                clipped += ref.value((vc - g) ** 2) > ref.value(err)
                err = torch.maximum(err, (vc - g) ** 2)
            terms[(i, t)] = 0.5 * err
    expected = ref.aggregate(terms, mask, mode)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, values)[0], torch.autograd.grad(expected, values)[0])
    assert math.isclose(float(metrics["vf_clipfrac"]), clipped / 8)


def test_entropy_term_is_masked_mean():
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert float(compute_entropy_term(entropy, mask)) == 2.0
