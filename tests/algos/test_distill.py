"""The distillation objectives against their formulas written out per token."""

import math

import pytest
import torch

from tandem.algos.distill import (
    DISTILL_ADVANTAGES,
    DISTILL_LOSSES,
    DistillConfig,
    distill_metrics,
    distilled_advantages,
    reverse_kl_advantages,
    top_k_jsd,
)


def _inputs(seed=0):
    generator = torch.Generator().manual_seed(seed)
    student = -torch.rand(3, 5, generator=generator) * 4
    teacher = -torch.rand(3, 5, generator=generator) * 4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    return student, teacher, mask


def test_the_reverse_kl_advantage_is_the_teachers_log_ratio_on_response_tokens():
    student, teacher, mask = _inputs()
    advantages = reverse_kl_advantages(student, teacher, mask)
    for b in range(3):
        for t in range(5):
            expected = float(teacher[b, t] - student[b, t]) if mask[b, t] else 0.0
            assert float(advantages[b, t]) == pytest.approx(expected, abs=1e-7)
    assert DISTILL_ADVANTAGES.get("reverse_kl") is reverse_kl_advantages
    assert DISTILL_LOSSES.get("jsd") is top_k_jsd


def test_the_distillation_advantage_adds_to_the_estimators_with_its_weights():
    student, teacher, mask = _inputs(1)
    rl = torch.randn(3, 5) * mask
    config = DistillConfig(objective="reverse_kl", coef=0.5, reward_coef=2.0)
    combined = distilled_advantages(rl, student, teacher, mask, config)
    expected = (2.0 * rl + 0.5 * (teacher - student)) * mask
    torch.testing.assert_close(combined, expected, rtol=0, atol=1e-6)
    alone = distilled_advantages(
        rl, student, teacher, mask, DistillConfig(objective="reverse_kl", reward_coef=0)
    )
    torch.testing.assert_close(alone, (teacher - student) * mask, rtol=0, atol=1e-6)


def test_distillation_metrics_average_over_response_tokens():
    student, teacher, mask = _inputs(2)
    metrics = distill_metrics(student, teacher, mask)
    picked = mask.bool()
    assert float(metrics["distill/reverse_kl"]) == pytest.approx(float((student - teacher)[picked].mean()))
    assert float(metrics["distill/teacher_log_prob"]) == pytest.approx(float(teacher[picked].mean()))
    assert float(metrics["distill/student_log_prob"]) == pytest.approx(float(student[picked].mean()))


def test_a_distillation_without_any_signal_is_refused():
    with pytest.raises(ValueError, match="both 0"):
        DistillConfig(objective="reverse_kl", coef=0.0, reward_coef=0.0)
    with pytest.raises(ValueError, match="lmbda=0.5 trains some steps on the dataset's responses"):
        DistillConfig(objective="reverse_kl", lmbda=0.5, reward_coef=0.0)
    with pytest.raises(ValueError, match="lmbda=0.5 with algorithm.distill.reward_coef=1.0"):
        DistillConfig(objective="jsd", lmbda=0.5)
    DistillConfig(objective="jsd", lmbda=0.5, reward_coef=0.0)
    with pytest.raises(ValueError, match="algorithm.distill.beta"):
        DistillConfig(objective="jsd", beta=1.5)
    DistillConfig(coef=0.0, reward_coef=0.0)  # off: nothing to check


def _kl(p, q):
    """KL(p || q) of two probability vectors, written out."""
    return sum(float(a) * (math.log(float(a)) - math.log(float(b))) for a, b in zip(p, q, strict=True))


def _coarse(log_probs_k):
    """The k tokens' probabilities and the rest's, written out (float64)."""
    probs = [math.exp(float(v)) for v in log_probs_k]
    return [*probs, 1.0 - sum(probs)]


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_the_top_k_jsd_matches_its_formula_over_the_k_tokens_and_the_rest(beta):
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 6, generator=generator, dtype=torch.float64)
    teacher = torch.log_softmax(torch.randn(2, 3, 6, generator=generator) * 3, -1)[..., :4]  # 4 of 6 tokens
    student = logits.clone().requires_grad_(True)  # the student's full distribution, differentiated
    values = top_k_jsd(torch.log_softmax(student, -1)[..., :4].float(), teacher, beta)
    for b in range(2):
        for t in range(3):
            p_s = _coarse(torch.log_softmax(logits[b, t], -1)[:4])
            p_t = _coarse(teacher[b, t])
            if beta == 0.0:
                expected = _kl(p_t, p_s)
            elif beta == 1.0:
                expected = _kl(p_s, p_t)
            else:
                mixture = [beta * a + (1 - beta) * c for a, c in zip(p_t, p_s, strict=True)]
                expected = beta * _kl(p_t, mixture) + (1 - beta) * _kl(p_s, mixture)
            assert float(values[b, t].detach()) == pytest.approx(expected, abs=1e-5)
    values.sum().backward()
    reference = logits.clone().requires_grad_(True)  # the same formula in float64 autograd
    full = torch.softmax(reference, -1)
    p_s = torch.cat([full[..., :4], full[..., 4:].sum(-1, keepdim=True)], -1)
    teacher_probs = teacher.double().exp()
    p_t = torch.cat([teacher_probs, 1 - teacher_probs.sum(-1, keepdim=True)], -1)
    if beta == 0.0:
        divergence = (p_t * (p_t.log() - p_s.log())).sum()
    elif beta == 1.0:
        divergence = (p_s * (p_s.log() - p_t.log())).sum()
    else:
        m = beta * p_t + (1 - beta) * p_s
        divergence = (beta * p_t * (p_t.log() - m.log()) + (1 - beta) * p_s * (p_s.log() - m.log())).sum()
    divergence.backward()
    torch.testing.assert_close(student.grad, reference.grad, rtol=0, atol=1e-5)


def test_the_top_k_jsd_never_exceeds_the_full_divergence_and_reaches_it_with_every_token():
    generator = torch.Generator().manual_seed(4)
    student = torch.log_softmax(torch.randn(5, 6, generator=generator), -1)
    teacher = torch.log_softmax(torch.randn(5, 6, generator=generator) * 2, -1)
    order = teacher.argsort(-1, descending=True)
    full = top_k_jsd(student.gather(-1, order), teacher.gather(-1, order), 0.5)  # all 6: nothing left over
    for k in (1, 3, 5):
        picked = order[:, :k]
        coarse = top_k_jsd(student.gather(-1, picked), teacher.gather(-1, picked), 0.5)
        assert torch.all(coarse <= full + 1e-6)
    m = 0.5 * teacher.exp() + 0.5 * student.exp()
    exact = 0.5 * (teacher.exp() * (teacher - m.log())).sum(-1) + 0.5 * (
        student.exp() * (student - m.log())
    ).sum(-1)
    torch.testing.assert_close(full, exact, rtol=0, atol=1e-5)


def test_the_top_k_jsd_is_zero_when_the_distributions_agree_even_saturated():
    teacher = torch.tensor([[0.0, -30.0, -60.0, -90.0]])  # nearly all mass on one token
    assert torch.allclose(top_k_jsd(teacher.clone(), teacher, 0.5), torch.zeros(1), atol=1e-7)
    assert torch.isfinite(top_k_jsd(teacher.flip(-1), teacher, 0.5)).all()
