"""How far apart two Adam runs' weights can end when their gradients differ by rounding.

Two runs of the same model (one process, several) start from the same weights and, step by step,
see gradients that agree up to the order of their reductions (relative differences ~1e-7 of a
tensor's largest entry). Adam divides each element's step by that element's own gradient scale,
so where an element's gradient is itself noise-level (near ``eps``, or near the difference), the
rounding becomes a visible part of the update: each run's step there is up to ~``lr`` either
way, so the weights can part by up to ~``2 lr`` a step, on one host and not on another. :func:`adam_gap_bound` bounds the gap per element from the two
runs' recorded gradients, so a test compares the gradients tightly and the weights by this bound.

The derivation (AdamW, weight decay 0, both runs from the same weights). With the bias
corrections folded in, step ``t`` moves an element by ``u_t = lr_t * m_t / (s_t + eps)`` with

    m_t = sum_i a_ti g_i,   a_ti = (1 - b1) b1^(t-i) / (1 - b1^t)       (weights summing to 1)
    s_t = sqrt(sum_i c_ti g_i^2),   c_ti = (1 - b2) b2^(t-i) / (1 - b2^t)

over the gradients ``g_1..g_t`` of the element. Then:

1. ``|m_t| / s_t <= B_t = sqrt(sum_i a_ti^2 / c_ti)`` (Cauchy-Schwarz), so each run moves the
   element at most ``lr_t * B_t`` (betas (0.9, 0.999): ``B_1 = 1``, ``B_3 = 1.004``,
   ``B_10 = 1.04``).
2. For runs with gradients ``g`` and ``h = g + d``, with ``r_g = |m_g| / (s_g + eps) <= B_t``:
   ``u(g) - u(h) = lr_t [(m_g - m_h) / (s_h + eps) + m_g (s_h - s_g) / ((s_g + eps)(s_h + eps))]``;
   ``|m_g - m_h| <= sum_i a_ti |d_i| = D_m`` and ``|s_g - s_h| <= sqrt(sum_i c_ti d_i^2) = D_s``
   (Minkowski), so ``|u(g) - u(h)| <= lr_t (D_m + r_g D_s) / (s_h + eps)``, and the same with
   the roles swapped; and ``|u(g) - u(h)| <= |u(g)| + |u(h)| = lr_t (r_g + r_h)``.

So ``|w_T(g) - w_T(h)| <= sum_t lr_t min((D_m + r_g D_s) / (s_h + eps), (D_m + r_h D_s) / (s_g + eps),
r_g + r_h)``: a few ``lr * d / g`` where an element's gradients are well above their
disagreement, and up to ``2 lr B_t`` a step where they are noise-level (the bound is attained
on a first step from a zero gradient). The float32 arithmetic of the updates themselves
(PyTorch's fused and foreach AdamW round differently) adds a few ulps a step.
"""

from __future__ import annotations

import math

import torch


def adam_gap_bound(
    left: list[torch.Tensor],
    right: list[torch.Tensor],
    lrs: list[float],
    betas: tuple[float, float],
    eps: float,
) -> torch.Tensor:
    """Per element, the largest ``|w_T(left) - w_T(right)|`` AdamW (weight decay 0) can reach from
    the same weights when run ``left`` sees gradients ``left[t]`` and run ``right`` sees
    ``right[t]`` at step ``t + 1`` (module docstring), in float64.

    Args:
        left / right: ``T`` gradients each, every one of the parameter's shape ``[*S]``.
        lrs: the ``T`` learning rates the steps used.

    Returns:
        ``[*S]`` float64: the bound, summed over the ``T`` steps.
    """
    if not len(left) == len(right) == len(lrs):
        raise ValueError(f"{len(left)} and {len(right)} gradients for {len(lrs)} learning rates")
    beta1, beta2 = betas
    left = [g.double() for g in left]
    right = [g.double() for g in right]
    bound = torch.zeros_like(left[0])
    for t, lr in enumerate(lrs, start=1):
        a = [(1 - beta1) * beta1 ** (t - i) / (1 - beta1**t) for i in range(1, t + 1)]
        c = [(1 - beta2) * beta2 ** (t - i) / (1 - beta2**t) for i in range(1, t + 1)]
        most = math.sqrt(sum(ai * ai / ci for ai, ci in zip(a, c, strict=True)))  # B_t
        (m_left, s_left), (m_right, s_right) = (
            (sum(ai * g for ai, g in zip(a, run[:t], strict=True)),
             sum(ci * g * g for ci, g in zip(c, run[:t], strict=True)).sqrt())
            for run in (left, right)
        )  # fmt: skip
        r_left, r_right = m_left.abs() / (s_left + eps), m_right.abs() / (s_right + eps)
        if max(float(r_left.max()), float(r_right.max())) > most * (1 + 1e-9):
            raise AssertionError(f"|m| / (s + eps) above B_{t} = {most}: the derivation is wrong")
        gaps = [g - h for g, h in zip(left[:t], right[:t], strict=True)]
        moment_gap = sum(ai * d.abs() for ai, d in zip(a, gaps, strict=True))  # D_m
        scale_gap = sum(ci * d * d for ci, d in zip(c, gaps, strict=True)).sqrt()  # D_s
        step_gap = torch.minimum(
            (moment_gap + r_left * scale_gap) / (s_right + eps),
            (moment_gap + r_right * scale_gap) / (s_left + eps),
        )
        bound += lr * torch.minimum(step_gap, r_left + r_right)
    return bound
