"""TRL's DPO loss types, CPO, AlphaPO, ORPO, the f-divergences, WPO, several losses with
weights, and KTO, each against its formula written out pair by pair (values and gradients by
autograd through the written-out formula, fp64 there, fp32 in tandem), saturated margins included."""

import math

import pytest
import torch

from tandem.algos.preference import (
    PreferenceInput,
    PreferenceLossConfig,
    UnpairedInput,
    compute_preference_loss,
    compute_unpaired_loss,
    kto_kl_estimate,
)
from tandem.algos.preference.base import f_divergence_score
from tandem.dpo.loss import row_summaries, shared_token_mask, wpo_weights
from tandem.engine.base import TokenOutputs
from tandem.protocol import Batch

TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def log_sigmoid(z):
    """``log σ(z)``, the branch that cannot overflow (smooth at 0, unlike a form with ``|z|``)."""
    return -torch.log1p(torch.exp(-z)) if z >= 0 else z - torch.log1p(torch.exp(z))


def sigmoid(z):
    return torch.exp(log_sigmoid(z))


def smoothed(z, eps):
    return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def nll(p, m):
    return -p["pc"] / m


def score(u, c):
    """f'(exp(u)) written out per divergence."""
    kind, a = c.f_divergence_type, c.f_alpha_divergence_coef
    if kind == "reverse_kl":
        return u
    if kind == "forward_kl":
        return 1 - 1 / torch.exp(u)
    if kind == "js_divergence":
        t = torch.exp(u)
        return torch.log(2 * t / (t + 1))
    return (torch.exp(u) ** (a - 1) - 1) / (a - 1)


def z_of(p, c):
    return c.beta * (score(p["pc"] - p["rc"], c) - score(p["pr"] - p["rr"], c))


def uc(p):
    return p["pc"] - p["rc"]


def ur(p):
    return p["pr"] - p["rr"]


def cpo_rewards(p, c, per_token):
    rc, rr = (p["pc"] / p["lc"], p["pr"] / p["lr"]) if per_token else (p["pc"], p["pr"])
    if c.alpha:
        rc, rr = (1 - torch.exp(rc) ** (-c.alpha)) / c.alpha, (1 - torch.exp(rr) ** (-c.alpha)) / c.alpha
    return rc, rr


def log1mexp(x):
    return torch.log(1 - torch.exp(x)) if x < -0.7 else torch.log(-torch.expm1(x))


def orpo(p, c, m):
    ac, ar = p["pc"] / p["lc"], p["pr"] / p["lr"]
    log_odds = (ac - ar) - (log1mexp(ac) - log1mexp(ar))
    return nll(p, m) - c.beta * log_sigmoid(log_odds)


# Per pair p (a dict of 0-d fp64 tensors), config c, mean chosen length m: the loss.
FAMILY = {
    "exo_pair": lambda p, c, m: (
        sigmoid(z_of(p, c)) * (log_sigmoid(z_of(p, c)) - math.log(1 - c.label_smoothing))
        + sigmoid(-z_of(p, c)) * (log_sigmoid(-z_of(p, c)) - math.log(c.label_smoothing))
    ),
    "nca_pair": lambda p, c, m: (
        -log_sigmoid(c.beta * uc(p)) - 0.5 * log_sigmoid(-c.beta * uc(p)) - 0.5 * log_sigmoid(-c.beta * ur(p))
    ),
    "bco_pair": lambda p, c, m: -log_sigmoid(c.beta * uc(p)) - log_sigmoid(-c.beta * ur(p)),
    "sppo_hard": lambda p, c, m: (uc(p) - 1 / (2 * c.beta)) ** 2 + (ur(p) + 1 / (2 * c.beta)) ** 2,
    "apo_zero": lambda p, c, m: 1 - sigmoid(c.beta * uc(p)) + sigmoid(c.beta * ur(p)),
    "apo_down": lambda p, c, m: sigmoid(c.beta * uc(p)) + 1 - sigmoid(c.beta * (uc(p) - ur(p))),
    "discopop": lambda p, c, m: (
        -log_sigmoid(z_of(p, c)) * (1 - sigmoid(z_of(p, c) / c.discopop_tau))
        + torch.exp(-z_of(p, c)) * sigmoid(z_of(p, c) / c.discopop_tau)
    ),
    "sigmoid_norm": lambda p, c, m: (
        -log_sigmoid(c.beta * (score(uc(p), c) / p["lc"] - score(ur(p), c) / p["lr"]))
    ),
    "sft": lambda p, c, m: nll(p, m),
    "cpo": lambda p, c, m: (
        smoothed(c.beta * (cpo_rewards(p, c, False)[0] - cpo_rewards(p, c, False)[1]), c.label_smoothing)
        + c.cpo_alpha * nll(p, m)
    ),
    "cpo_hinge": lambda p, c, m: (
        torch.clamp(1 - c.beta * (cpo_rewards(p, c, False)[0] - cpo_rewards(p, c, False)[1]), min=0)
        + c.cpo_alpha * nll(p, m)
    ),
    "cpo_ipo": lambda p, c, m: (
        (cpo_rewards(p, c, True)[0] - cpo_rewards(p, c, True)[1] - 1 / (2 * c.beta)) ** 2
        + c.cpo_alpha * nll(p, m)
    ),
    "cpo_simpo": lambda p, c, m: (
        smoothed(
            c.beta * (cpo_rewards(p, c, True)[0] - cpo_rewards(p, c, True)[1]) - c.gamma, c.label_smoothing
        )
        + c.cpo_alpha * nll(p, m)
    ),
    "orpo": orpo,
}
FAMILY["alphapo"] = FAMILY["cpo_simpo"]
SORTED = ("aot", "aot_unpaired")  # whole-batch losses, checked below


def _inputs(pairs=10, saturate=True, seed=0):
    """Pairs with log-probs below 0; with ``saturate`` the last two have margins of ±50 (β=1)."""
    gen = torch.Generator().manual_seed(seed)
    pc = -torch.rand(pairs, generator=gen, dtype=torch.float64) * 6 - 0.2
    pr = -torch.rand(pairs, generator=gen, dtype=torch.float64) * 6 - 0.2
    rc = -torch.rand(pairs, generator=gen, dtype=torch.float64) * 6 - 0.2
    rr = -torch.rand(pairs, generator=gen, dtype=torch.float64) * 6 - 0.2
    lc = torch.randint(1, 9, (pairs,), generator=gen).double()
    lr = torch.randint(1, 9, (pairs,), generator=gen).double()
    if saturate:  # u_c - u_r = +50 and -50
        pc[-2], pr[-2], rc[-2], rr[-2] = -1.0, -60.0, -2.0, -11.0
        pc[-1], pr[-1], rc[-1], rr[-1] = -60.0, -1.0, -11.0, -2.0
    return {"pc": pc, "pr": pr, "rc": rc, "rr": rr, "lc": lc, "lr": lr}


def _tandem(values, config, mean_length):
    """tandem's fp32 losses ``[P]`` and the gradients of their sum w.r.t. π_c, π_r."""
    pc = values["pc"].float().requires_grad_()
    pr = values["pr"].float().requires_grad_()
    x = PreferenceInput(
        pc,
        pr,
        values["rc"].float(),
        values["rr"].float(),
        values["lc"].float(),
        values["lr"].float(),
        mean_length,
    )
    losses = compute_preference_loss(x, config).loss
    losses.sum().backward()
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (pc, pr)]
    return losses.detach().double(), grads[0].double(), grads[1].double()


def _written_out(values, formula, config, mean_length):
    losses, grads_c, grads_r = [], [], []
    for i in range(len(values["pc"])):
        pair = {k: v[i].clone() for k, v in values.items()}
        pair["pc"].requires_grad_()
        pair["pr"].requires_grad_()
        loss = formula(pair, config, mean_length)
        grad_c, grad_r = torch.autograd.grad(loss, (pair["pc"], pair["pr"]), allow_unused=True)
        losses.append(loss.detach())
        grads_c.append(torch.zeros(()) if grad_c is None else grad_c)
        grads_r.append(torch.zeros(()) if grad_r is None else grad_r)
    return torch.stack(losses).double(), torch.stack(grads_c).double(), torch.stack(grads_r).double()


def _check(values, formula, config, mean_length=4.0):
    ours = _tandem(values, config, mean_length)
    expected = _written_out(values, formula, config, mean_length)
    for what, a, b in zip(("loss", "d/dπ_c", "d/dπ_r"), ours, expected, strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, w=what: f"{config.name} {w}: {m}")


@pytest.mark.parametrize("name", sorted(FAMILY))
def test_each_loss_matches_its_formula_with_saturated_margins(name):
    settings = {"label_smoothing": 0.1, "gamma": 0.3, "cpo_alpha": 0.7}
    if name == "alphapo":
        settings["alpha"] = 0.25
    config = PreferenceLossConfig(name=name, beta=1.0, **settings)
    values = _inputs(saturate=name not in ("orpo",))
    if name == "discopop":  # e^(-z) at z = -50 is 5e21: compare where fp32 holds the value to 1e-5
        values = {k: v[:-1] for k, v in values.items()}
    _check(values, FAMILY[name], config)


def test_orpo_at_saturated_odds():
    """ORPO with per-token log-probs near 0 and far below it (odds of ±50 in log space)."""
    values = _inputs(pairs=4, saturate=False)
    values["pc"][0], values["lc"][0] = -1e-3, 1.0  # p ≈ 1: log odds ≈ 6.9
    values["pr"][1], values["lr"][1] = -50.0, 1.0  # p ≈ e^-50
    _check(values, orpo, PreferenceLossConfig(name="orpo", beta=0.5))


@pytest.mark.parametrize("alpha", [0.25, -0.5])
def test_cpo_with_alphapo_shaping(alpha):
    for name in ("cpo", "cpo_hinge", "cpo_ipo", "cpo_simpo"):
        config = PreferenceLossConfig(name=name, beta=0.5, alpha=alpha, gamma=0.2)
        _check(_inputs(saturate=False), FAMILY[name], config)


def _preference_input(values, mean_length):
    fields = ("pc", "pr", "rc", "rr", "lc", "lr")
    return PreferenceInput(*(values[k].float() for k in fields), mean_length)


@pytest.mark.parametrize("name", ["cpo", "cpo_hinge", "cpo_ipo", "cpo_simpo", "alphapo"])
def test_cpo_without_its_nll_term_logs_nll_loss_zero_as_trl_does(name):
    """TRL's CPOTrainer logs ``nll_loss`` 0 when ``cpo_alpha=0`` (SimPO's setting) and the chosen
    NLL otherwise; a combination with a loss that adds the NLL logs that NLL, in either order."""
    settings = {"beta": 0.5, "gamma": 0.2, "alpha": 0.25 if name == "alphapo" else 0.0}
    values, mean_length = _inputs(saturate=False), 4.0
    without = PreferenceLossConfig(name=name, cpo_alpha=0.0, **settings)
    _check(values, FAMILY[name], without)  # the loss is the preference term alone
    x = _preference_input(values, mean_length)
    assert torch.equal(
        compute_preference_loss(x, without).metrics["nll_loss"], torch.zeros(len(values["pc"]))
    )
    expected = (-values["pc"] / mean_length).float()  # the chosen responses' per-token NLL
    with_nll = compute_preference_loss(x, PreferenceLossConfig(name=name, cpo_alpha=0.7, **settings))
    torch.testing.assert_close(with_nll.metrics["nll_loss"], expected, rtol=0, atol=0)
    for names in ((name, "sft"), ("sft", name)):
        combined = PreferenceLossConfig(names=names, weights=(1.0, 1.0), cpo_alpha=0.0, **settings)
        torch.testing.assert_close(
            compute_preference_loss(x, combined).metrics["nll_loss"], expected, rtol=0, atol=0
        )


@pytest.mark.parametrize("divergence", ["forward_kl", "js_divergence", "alpha_divergence"])
@pytest.mark.parametrize(
    "name", ["sigmoid", "hinge", "ipo", "robust", "exo_pair", "discopop", "sigmoid_norm"]
)
def test_f_divergences_change_the_scores_as_written(name, divergence):
    config = PreferenceLossConfig(
        name=name, beta=0.5, f_divergence_type=divergence, f_alpha_divergence_coef=0.3, label_smoothing=0.1
    )
    reference_losses = {
        "sigmoid": lambda p, c, m: smoothed(z_of(p, c), c.label_smoothing),
        "hinge": lambda p, c, m: torch.clamp(1 - z_of(p, c), min=0),
        "ipo": lambda p, c, m: (
            (score(uc(p), c) / p["lc"] - score(ur(p), c) / p["lr"] - 1 / (2 * c.beta)) ** 2
        ),
        "robust": lambda p, c, m: (
            (
                (1 - c.label_smoothing) * -log_sigmoid(z_of(p, c))
                + c.label_smoothing * log_sigmoid(-z_of(p, c))
            )
            / (1 - 2 * c.label_smoothing)
        ),
    }
    formula = reference_losses.get(name) or FAMILY[name]
    _check(_inputs(saturate=False), formula, config)


def test_f_divergence_scores_at_extreme_log_ratios_stay_finite():
    u = torch.tensor([-50.0, 0.0, 50.0, 200.0])
    for kind in ("forward_kl", "js_divergence", "alpha_divergence"):
        values = f_divergence_score(u, kind, 0.5)
        assert torch.isfinite(values[:3]).all(), kind
    # α-divergence's exponent is clamped at 80 as in TRL: (e^80 - 1)/(α-1) at α=2, u=200
    assert f_divergence_score(u, "alpha_divergence", 2.0)[3].item() == pytest.approx(
        math.expm1(80.0), rel=1e-6
    )


@pytest.mark.parametrize("name", SORTED)
def test_aot_sorts_over_the_batch(name):
    values = _inputs(saturate=True)
    config = PreferenceLossConfig(name=name, beta=0.7, label_smoothing=0.1)
    pc, pr = values["pc"].clone().requires_grad_(), values["pr"].clone().requires_grad_()
    if name == "aot":
        policy, reference = pc - pr, values["rc"] - values["rr"]
    else:
        policy, reference = pc - values["rc"], pr - values["rr"]
    order_p = sorted(range(len(pc)), key=lambda i: policy[i].item())
    order_r = sorted(range(len(pc)), key=lambda i: reference[i].item())
    written = torch.stack(
        [smoothed(0.7 * (policy[i] - reference[j]), 0.1) for i, j in zip(order_p, order_r, strict=True)]
    )
    written.sum().backward()
    ours = _tandem(values, config, None)
    torch.testing.assert_close(ours[0], written.detach(), **TOLERANCE)
    torch.testing.assert_close(ours[1], pc.grad, **TOLERANCE)
    torch.testing.assert_close(ours[2], pr.grad, **TOLERANCE)


def test_weighted_losses_are_the_weighted_sum_of_single_losses():
    values = _inputs()
    names, weights = ("sigmoid", "bco_pair", "sft"), (0.8, 0.2, 1.0)
    combined = _tandem(values, PreferenceLossConfig(names=names, weights=weights, beta=0.3), 5.0)
    singles = [_tandem(values, PreferenceLossConfig(name=n, beta=0.3), 5.0) for n in names]
    for k in range(3):
        expected = sum(w * single[k] for w, single in zip(weights, singles, strict=True))
        torch.testing.assert_close(combined[k], expected, **TOLERANCE)
    config = PreferenceLossConfig(names=names, weights=weights)
    assert config.losses == (("sigmoid", 0.8), ("bco_pair", 0.2), ("sft", 1.0)) and config.needs_reference
    assert not PreferenceLossConfig(names=("cpo", "sft")).needs_reference


def test_wpo_weights_multiply_each_pair_loss():
    values = _inputs(saturate=False)
    gen = torch.Generator().manual_seed(3)
    wc, wr = torch.rand(10, generator=gen), torch.rand(10, generator=gen)
    x = PreferenceInput(*(values[k].float() for k in ("pc", "pr", "rc", "rr", "lc", "lr")), None, wc, wr)
    weighted = compute_preference_loss(x, PreferenceLossConfig(use_weighting=True)).loss
    plain = compute_preference_loss(x, PreferenceLossConfig()).loss
    torch.testing.assert_close(weighted, plain * wc * wr, **TOLERANCE)


def _token_rows():
    """Two pairs as four rows of 7 positions: chosen then rejected, responses of 3 vs 5 and 4 vs 2 tokens."""
    mask = torch.zeros(4, 7, dtype=torch.long)
    for row, (start, length) in enumerate([(2, 3), (2, 5), (1, 4), (1, 2)]):
        mask[row, start : start + length] = 1
    rows = Batch(
        {"loss_mask": mask, "pair": torch.tensor([0, 0, 1, 1]), "chosen": torch.tensor([1, 0, 1, 0])}
    )
    gen = torch.Generator().manual_seed(0)
    outputs = TokenOutputs(
        log_probs=-torch.rand(4, 7, generator=gen) * 3,
        sum_pi_squared=torch.rand(4, 7, generator=gen) * 0.9 + 0.05,
    )
    return rows, outputs


def test_ld_dpo_weights_the_tokens_past_the_shorter_response():
    rows, outputs = _token_rows()
    alpha = 0.3
    shared_lengths = [3, 3, 2, 2]
    expected = []
    for row in range(4):
        seen, total = 0, 0.0
        for t in range(7):
            if rows["loss_mask"][row, t]:
                seen += 1
                weight = 1.0 if seen <= shared_lengths[row] else alpha
                total += weight * outputs.log_probs[row, t].item()
        expected.append(total)
    got = row_summaries(rows, outputs, alpha, with_weights=False)["score"]
    torch.testing.assert_close(got, torch.tensor(expected), **TOLERANCE)
    assert shared_token_mask(rows).sum(-1).tolist() == shared_lengths
    plain = row_summaries(rows, outputs, None, with_weights=False)["score"]
    torch.testing.assert_close(plain, (outputs.log_probs * rows["loss_mask"]).sum(-1))


def test_wpo_weight_is_the_mean_aligned_probability():
    rows, outputs = _token_rows()
    got = wpo_weights(outputs, rows["loss_mask"])
    for row in range(4):
        terms = [
            outputs.log_probs[row, t].item() - math.log(outputs.sum_pi_squared[row, t].item())
            for t in range(7)
            if rows["loss_mask"][row, t]
        ]
        assert got[row].item() == pytest.approx(math.exp(sum(terms) / len(terms)), rel=1e-5)


@pytest.mark.parametrize("name", ["kto", "apo_zero_unpaired"])
def test_kto_matches_its_formula(name):
    gen = torch.Generator().manual_seed(1)
    rows = 12
    policy = (-torch.rand(rows, generator=gen) * 20).requires_grad_()
    reference = -torch.rand(rows, generator=gen) * 20
    desirable = torch.rand(rows, generator=gen) > 0.4
    policy.data[0], reference[0], desirable[0] = -1.0, -60.0, True  # saturated: β u = 59
    policy.data[1], reference[1], desirable[1] = -60.0, -1.0, False
    kl_policy, kl_reference = -torch.rand(rows, generator=gen) * 20, -torch.rand(rows, generator=gen) * 20
    kl = kto_kl_estimate(kl_policy, kl_reference)
    assert kl.item() == pytest.approx(max(0.0, sum((kl_policy - kl_reference).tolist()) / rows), rel=1e-6)
    config = PreferenceLossConfig(name=name, beta=1.0, desirable_weight=1.3, undesirable_weight=0.6)
    output = compute_unpaired_loss(UnpairedInput(policy, reference, desirable, kl), config)
    output.loss.sum().backward()
    z = kl.double() if name == "kto" else torch.zeros((), dtype=torch.float64)
    for i in range(rows):
        p = policy[i].detach().double().requires_grad_()
        u = p - reference[i].double()
        if name == "kto":
            loss = 1.3 * (1 - sigmoid(u - z)) if desirable[i] else 0.6 * (1 - sigmoid(z - u))
        else:
            loss = 1.3 * (1 - sigmoid(u)) if desirable[i] else 0.6 * sigmoid(u)
        (grad,) = torch.autograd.grad(loss, p)
        assert output.loss[i].item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        assert policy.grad[i].item() == pytest.approx(grad.item(), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(output.rewards, (policy - reference).detach())
