"""Every preference loss against its formula written out element by element (values and gradients)."""

import math
import re

import pytest
import torch

from tandem.algos.preference import (
    PREFERENCE_LOSSES,
    PreferenceInput,
    PreferenceLossConfig,
    compute_preference_loss,
)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def log_sigmoid(x):
    return -math.log1p(math.exp(-x))


# Per pair: (loss, dL/d policy_chosen, dL/d policy_rejected), from plain floats.
def reference_sigmoid(pc, pr, rc, rr, lc, lr, c):
    z = c.beta * ((pc - rc) - (pr - rr))
    e = c.label_smoothing
    d = c.beta * (-(1 - e) * sigmoid(-z) + e * sigmoid(z))
    return -(1 - e) * log_sigmoid(z) - e * log_sigmoid(-z), d, -d


def reference_robust(pc, pr, rc, rr, lc, lr, c):
    z = c.beta * ((pc - rc) - (pr - rr))
    e = c.label_smoothing
    loss = ((1 - e) * -log_sigmoid(z) + e * log_sigmoid(-z)) / (1 - 2 * e)
    d = c.beta * (-(1 - e) * sigmoid(-z) - e * sigmoid(z)) / (1 - 2 * e)
    return loss, d, -d


def reference_hinge(pc, pr, rc, rr, lc, lr, c):
    z = c.beta * ((pc - rc) - (pr - rr))
    d = -c.beta if z < 1 else 0.0
    return max(0.0, 1 - z), d, -d


def reference_ipo(pc, pr, rc, rr, lc, lr, c):
    h = (pc - rc) / lc - (pr - rr) / lr
    gap = h - 1 / (2 * c.beta)
    return gap**2, 2 * gap / lc, -2 * gap / lr


def reference_simpo(pc, pr, rc, rr, lc, lr, c):
    z = c.beta * (pc / lc - pr / lr) - c.gamma
    e = c.label_smoothing
    d = -(1 - e) * sigmoid(-z) + e * sigmoid(z)
    return -(1 - e) * log_sigmoid(z) - e * log_sigmoid(-z), d * c.beta / lc, -d * c.beta / lr


def reference_bradley_terry(pc, pr, rc, rr, lc, lr, c):
    z = c.beta * (pc - pr)
    e = c.label_smoothing
    d = c.beta * (-(1 - e) * sigmoid(-z) + e * sigmoid(z))
    return -(1 - e) * log_sigmoid(z) - e * log_sigmoid(-z), d, -d


REFERENCES = {
    "sigmoid": reference_sigmoid,
    "robust": reference_robust,
    "hinge": reference_hinge,
    "ipo": reference_ipo,
    "simpo": reference_simpo,
    "bradley_terry": reference_bradley_terry,
}


def test_every_registered_loss_has_a_written_out_reference():
    from tests.dpo.test_loss_family import FAMILY, SORTED

    assert sorted([*REFERENCES, *FAMILY, *SORTED]) == PREFERENCE_LOSSES.names()


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_loss_values_and_gradients_match_the_formula(name, smoothing):
    gen = torch.Generator().manual_seed(0)
    pairs = 12
    policy_c = (-torch.rand(pairs, generator=gen, dtype=torch.float64) * 20).requires_grad_()
    policy_r = (-torch.rand(pairs, generator=gen, dtype=torch.float64) * 20).requires_grad_()
    ref_c = -torch.rand(pairs, generator=gen, dtype=torch.float64) * 20
    ref_r = -torch.rand(pairs, generator=gen, dtype=torch.float64) * 20
    len_c = torch.randint(1, 9, (pairs,), generator=gen).double()
    len_r = torch.randint(1, 9, (pairs,), generator=gen).double()
    config = PreferenceLossConfig(name=name, beta=0.3, label_smoothing=smoothing, gamma=0.4)
    inputs = PreferenceInput(policy_c, policy_r, ref_c, ref_r, len_c, len_r)
    output = compute_preference_loss(inputs, config)
    losses, chosen_rewards, rejected_rewards = output.loss, output.chosen_rewards, output.rejected_rewards
    losses.sum().backward()
    for i in range(pairs):
        args = [t[i].item() for t in (policy_c, policy_r, ref_c, ref_r, len_c, len_r)]
        loss, grad_c, grad_r = REFERENCES[name](*args, config)
        assert losses[i].item() == pytest.approx(loss, rel=1e-9, abs=1e-12)
        assert policy_c.grad[i].item() == pytest.approx(grad_c, rel=1e-9, abs=1e-12)
        assert policy_r.grad[i].item() == pytest.approx(grad_r, rel=1e-9, abs=1e-12)
    if name == "simpo":  # reference-free: the rewards are the scaled length-normalised log-probs
        assert torch.allclose(chosen_rewards, 0.3 * policy_c.detach() / len_c)
    elif name == "bradley_terry":  # reference-free: the rewards are the scaled scores
        assert torch.allclose(chosen_rewards, 0.3 * policy_c.detach())
        assert torch.allclose(rejected_rewards, 0.3 * policy_r.detach())
    elif name == "ipo":
        assert torch.allclose(chosen_rewards, 0.3 * (policy_c.detach() - ref_c) / len_c)
    else:
        assert torch.allclose(chosen_rewards, 0.3 * (policy_c.detach() - ref_c))
        assert torch.allclose(rejected_rewards, 0.3 * (policy_r.detach() - ref_r))


def test_at_equal_policy_and_reference_dpo_is_log_2():
    zero = torch.zeros(3)
    inputs = PreferenceInput(zero - 5, zero - 7, zero - 5, zero - 7, zero + 2, zero + 2)
    losses = compute_preference_loss(inputs, PreferenceLossConfig()).loss
    assert torch.allclose(losses, torch.full((3,), math.log(2)))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": "kto_pair"}, "preference.name='kto_pair' is not a preference loss"),
        ({"names": ("sigmoid", "dpo")}, "preference.names[1]='dpo' is not a paired preference loss"),
        (
            {"names": ("sigmoid", "sft"), "weights": (1.0,)},
            "preference.weights has 1 values but preference.names has 2",
        ),
        ({"weights": (1.0,)}, "preference.weights is set without preference.names"),
        ({"names": ("kto",)}, "preference.names[0]='kto' is not a paired preference loss"),
        (
            {"name": "bco_pair", "f_divergence_type": "js_divergence"},
            "preference.f_divergence_type='js_divergence'",
        ),
        ({"f_divergence_type": "chi2"}, "preference.f_divergence_type"),
        ({"ld_alpha": 1.5}, "preference.ld_alpha"),
        ({"name": "exo_pair"}, "preference.label_smoothing must be > 0 for exo_pair"),
        ({"name": "alphapo"}, "preference.alpha must be non-zero"),
        ({"name": "aot", "use_weighting": True}, "preference.use_weighting"),
        ({"name": "kto", "ld_alpha": 0.5}, "preference.name='kto' is unpaired"),
        ({"name": "kto", "desirable_weight": 0.0}, "preference.desirable_weight"),
        ({"beta": 0.0}, "preference.beta"),
        ({"label_smoothing": 0.5}, "preference.label_smoothing"),
        ({"rpo_alpha": -1.0}, "preference.rpo_alpha"),
    ],
)
def test_bad_loss_settings_are_named(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        PreferenceLossConfig(**overrides)
