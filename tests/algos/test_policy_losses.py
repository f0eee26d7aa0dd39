"""Every policy loss against its per-token loop reference: value and gradient."""

import dataclasses

import pytest
import torch

from tandem.algos import POLICY_LOSSES, PolicyLossConfig, PolicyLossInput, compute_policy_loss
from tandem.algos.aggregation import LOSS_AGG_MODES
from tests.algos import reference as ref

TOKEN_LOSSES = {
    "ppo": ref.ppo_token,
    "cispo": ref.cispo_token,
    "gpg": ref.gpg_token,
    "sapo": ref.sapo_token,
    "dppo_tv": ref.dppo_tv_token,
    "dppo_kl": ref.dppo_kl_token,
    "dro": ref.dro_token,
}


def make_inputs(seed: int, batch: int = 6, length: int = 5, extreme: bool = False):
    """Log-probs near a behaviour policy, with an empty row and (optionally) extreme ratios."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3 - 0.05
    shift = torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.3
    if extreme:
        shift[0, :2] = torch.tensor([25.0, -30.0])  # beyond the log-ratio clamp
        shift[2, 0] = 4.0
    log_probs = (old + shift).clamp(max=-1e-3).requires_grad_(True)
    advantages = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    advantages[3] = 0.0  # a sequence with zero advantage
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[1] = 0  # an empty response
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()
    return log_probs, old, advantages, mask


def grad_of(loss, log_probs):
    (grad,) = torch.autograd.grad(loss, log_probs, allow_unused=True)
    return torch.zeros_like(log_probs) if grad is None else grad


def check_against(reference_loss, out, log_probs):
    torch.testing.assert_close(out.loss, reference_loss, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(
        grad_of(out.loss, log_probs), grad_of(reference_loss, log_probs), atol=1e-10, rtol=1e-9
    )


@pytest.mark.parametrize("name", sorted(TOKEN_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed,extreme,clamp", [(0, False, 20.0), (1, True, 20.0), (2, True, None)])
def test_token_losses_match_reference(name, mode, seed, extreme, clamp):
    log_probs, old, adv, mask = make_inputs(seed, extreme=extreme)
    cfg = PolicyLossConfig(
        name=name,
        loss_agg_mode=mode,
        clip_ratio_high=0.28,
        norm_length=9.0,
        dro_beta=0.7,
        log_ratio_clamp=clamp,
    )
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask), cfg)
    check_against(
        ref.token_loss_reference(TOKEN_LOSSES[name], log_probs, old, adv, mask, cfg), out, log_probs
    )
    assert all(torch.isfinite(v) for v in out.metrics.values())


def test_ppo_without_dual_clip_and_with_rollout_weights():
    log_probs, old, adv, mask = make_inputs(4, extreme=True)
    weights = torch.rand(log_probs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    cfg = PolicyLossConfig(name="ppo", clip_ratio_c=None)
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask, rollout_is_weights=weights), cfg)
    check_against(
        ref.token_loss_reference(ref.ppo_token, log_probs, old, adv, mask, cfg, weights), out, log_probs
    )


def test_ppo_clip_fractions_count_tokens():
    log_probs = torch.log(torch.tensor([[0.5, 0.5, 0.5, 0.5]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.1, 0.5, 0.5, 0.1]], dtype=torch.float64))  # ratios 5, 1, 1, 5
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    out = compute_policy_loss(
        PolicyLossInput(log_probs, old, adv, torch.ones(1, 4)), PolicyLossConfig(name="ppo")
    )
    assert float(out.metrics["pg_clipfrac"]) == 0.25  # token 0: ratio 5 > 1.2 with A > 0
    assert float(out.metrics["pg_clipfrac_lower"]) == 0.25  # token 3: -A*5 > -A*3 caps at c=3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_matches_reference(seed):
    log_probs, old, adv, mask = make_inputs(seed)
    cfg = PolicyLossConfig(
        name="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-2, clip_ratio_high=4e-2
    )
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask), cfg)
    check_against(ref.gspo_reference(log_probs, old, adv, mask, cfg), out, log_probs)


def test_gspo_gradient_equals_sequence_level_gradient():
    """With one advantage per sequence, GSPO-token's gradient is that of -A_i * s_i(theta) (unclipped)."""
    log_probs, old, _, mask = make_inputs(7)
    adv = torch.randn(log_probs.shape[0], 1, dtype=torch.float64).expand_as(log_probs).contiguous()
    cfg = PolicyLossConfig(
        name="gspo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.9, clip_ratio_high=100.0
    )
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask), cfg)
    m = mask.double()
    lengths = m.sum(-1)
    seq_ratio = torch.exp(((log_probs - old) * m).sum(-1) / lengths.clamp(min=1))
    sequence_loss = (-(adv[:, 0] * seq_ratio) * (lengths > 0)).sum() / (lengths > 0).sum()
    torch.testing.assert_close(grad_of(out.loss, log_probs), grad_of(sequence_loss, log_probs))


@pytest.mark.parametrize("seed,extreme", [(0, False), (1, True)])
@pytest.mark.parametrize("clamp", [20.0, None])
@pytest.mark.parametrize("weight_mean", [None, "arithmetic", "geometric"])
def test_gmpo_matches_reference(seed, extreme, clamp, weight_mean):
    log_probs, old, adv, mask = make_inputs(seed, extreme=extreme)
    weights = None
    if weight_mean is not None:
        weights = torch.rand(
            log_probs.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
        )
    cfg = PolicyLossConfig(
        name="gmpo",
        clip_ratio_low=0.4,
        clip_ratio_high=0.4,
        log_ratio_clamp=clamp,
        gmpo_is_weight_mean=weight_mean or "arithmetic",
    )
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask, rollout_is_weights=weights), cfg)
    check_against(ref.gmpo_reference(log_probs, old, adv, mask, cfg, weights), out, log_probs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_reference(seed):
    log_probs, old, adv, mask = make_inputs(seed, batch=10, length=8)
    cfg = PolicyLossConfig(name="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-0.5, clip_cov_ub=0.8)
    priorities = torch.rand(
        log_probs.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    generator = torch.Generator().manual_seed(seed)
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask, generator=generator), cfg)
    expected, chosen = ref.clip_cov_reference(log_probs, old, adv, mask, cfg, priorities)
    assert chosen > 0
    check_against(expected, out, log_probs)
    torch.testing.assert_close(
        out.metrics["pg_clipfrac"], torch.tensor(chosen / mask.sum().item(), dtype=torch.float64)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kl_cov_matches_reference(seed):
    log_probs, old, adv, mask = make_inputs(seed, batch=10, length=8)
    cfg = PolicyLossConfig(name="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=2.0)
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask), cfg)
    check_against(ref.kl_cov_reference(log_probs, old, adv, mask, cfg), out, log_probs)


def test_cispo_keeps_gradient_on_clipped_tokens_where_ppo_drops_it():
    log_probs = torch.log(torch.tensor([[0.9]], dtype=torch.float64)).requires_grad_(True)
    old = torch.log(torch.tensor([[0.3]], dtype=torch.float64))  # ratio 3, far above 1 + eps
    adv = torch.ones(1, 1, dtype=torch.float64)
    inputs = PolicyLossInput(log_probs, old, adv, torch.ones(1, 1))
    ppo = compute_policy_loss(inputs, PolicyLossConfig(name="ppo"))
    cispo = compute_policy_loss(inputs, PolicyLossConfig(name="cispo"))
    assert grad_of(ppo.loss, log_probs).abs().item() == 0.0
    torch.testing.assert_close(grad_of(cispo.loss, log_probs), torch.tensor([[-1.2]], dtype=torch.float64))


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_every_loss_is_the_policy_gradient_on_policy(name):
    """At pi_theta = pi_old every registered loss has the REINFORCE gradient -A * d log pi (token-mean)."""
    log_probs, _, adv, mask = make_inputs(11)
    old = log_probs.detach().clone()
    cfg = PolicyLossConfig(name=name, dro_beta=0.5)
    if name == "gspo" or name == "gmpo":  # sequence-level ratios: compare with per-sequence advantages
        adv = adv[:, :1].expand_as(adv).contiguous()
        cfg = dataclasses.replace(cfg, loss_agg_mode="seq-mean-token-mean")
    inputs = PolicyLossInput(log_probs, old, adv, mask)
    generator = torch.Generator().manual_seed(0)
    if name in ("clip_cov", "kl_cov"):  # they intentionally alter a few tokens; check the rest
        inputs = dataclasses.replace(inputs, generator=generator)
    out = compute_policy_loss(inputs, cfg)
    grad = grad_of(out.loss, log_probs)
    reinforce = ref.token_loss_reference(ref.gpg_token, log_probs, old, adv, mask, cfg)
    expected = grad_of(reinforce, log_probs)
    if name == "clip_cov":  # exactly one token (k = 1) has its gradient removed
        assert int(((grad - expected).abs() > 1e-12).sum()) <= 1
    else:  # kl_cov's |log ratio| penalty has zero subgradient at 0 under torch's abs
        torch.testing.assert_close(grad, expected, atol=1e-12, rtol=1e-9)
    assert torch.isfinite(out.loss)


@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("region", ["inside", "negative"])
def test_dppo_zero_advantage_region_changes_only_the_clip_fraction(name, region):
    log_probs, old, adv, mask = make_inputs(3, extreme=True)
    adv = adv.clone()
    adv[:, 1::2] = 0.0  # many zero-advantage tokens, some of them far below their old probability
    cfg = PolicyLossConfig(name=name, dppo_zero_advantage_region=region, dppo_divergence_low=0.01)
    out = compute_policy_loss(PolicyLossInput(log_probs, old, adv, mask), cfg)
    check_against(
        ref.token_loss_reference(TOKEN_LOSSES[name], log_probs, old, adv, mask, cfg), out, log_probs
    )
    kind = name.removeprefix("dppo_")
    cells = [(i, t) for i in range(mask.shape[0]) for t in ref.valid_positions(mask[i])]
    outside = [not ref.dppo_inside(kind, log_probs[c], float(old[c]), float(adv[c]), cfg) for c in cells]
    assert float(out.metrics["pg_clipfrac"]) == pytest.approx(sum(outside) / len(cells))
    zero_outside = [o for o, c in zip(outside, cells, strict=True) if adv[c] == 0]
    assert any(zero_outside) == (region == "negative")


def test_bad_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="advantages has shape"):
        PolicyLossInput(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
