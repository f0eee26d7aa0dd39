"""The Adam gap bound against PyTorch's AdamW in float64: never exceeded, attained where it should be."""

import torch

from tests.sft.adam_bound import adam_gap_bound

BETAS, EPS = (0.9, 0.999), 1e-8


def adamw_weights(start: torch.Tensor, gradients: list[torch.Tensor], lrs: list[float]) -> torch.Tensor:
    """PyTorch's AdamW (weight decay 0) from ``start``, stepped with ``gradients`` in turn."""
    weight = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.AdamW([weight], lr=lrs[0], betas=BETAS, eps=EPS, weight_decay=0.0, foreach=False)
    for gradient, lr in zip(gradients, lrs, strict=True):
        optimizer.param_groups[0]["lr"] = lr
        weight.grad = gradient.clone()
        optimizer.step()
    return weight.detach()


def signed(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random signs times 1 .. 2."""
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1
    return sign * (1 + torch.rand(shape, generator=gen, dtype=torch.float64))


def test_the_bound_holds_for_gradients_at_every_scale():
    """Elements whose gradients range from 1e-10 (below ``eps``) to 1, perturbed by 1e-9 .. 1e-3: the
    float64 AdamW runs part by no more than the bound, which is small where gradients are large."""
    gen = torch.Generator().manual_seed(0)
    shape, steps, lrs = (6, 2000), 4, [3e-3, 3e-3, 1e-3, 2e-3]
    magnitude = 10 ** torch.linspace(-10, 0, shape[1], dtype=torch.float64).expand(shape)
    noise = 10 ** torch.tensor([-9.0, -8, -7, -6, -5, -3], dtype=torch.float64)[:, None]
    left = [signed(shape, gen) * magnitude for _ in range(steps)]  # 1 .. 2 times the magnitude
    right = [g + signed(shape, gen) * noise for g in left]
    start = torch.randn(shape, generator=gen, dtype=torch.float64)
    gap = (adamw_weights(start, left, lrs) - adamw_weights(start, right, lrs)).abs()
    bound = adam_gap_bound(left, right, lrs, BETAS, EPS)
    assert bool((gap <= bound + 1e-15).all())
    assert float(gap.max()) > 0.5 * sum(lrs)  # noise-level gradients really do move that far apart
    large = magnitude > 1e3 * noise  # gradients a thousand times their disagreement
    assert float(bound[large].max()) < 1e-2 * sum(lrs)


def test_the_bound_is_attained_on_a_first_step_from_a_zero_gradient():
    """Step 1 moves ``lr * g / (|g| + eps)``: a zero gradient against ``d`` parts by ``lr * d / (d + eps)``,
    which is the bound."""
    left, right = (
        [torch.zeros(3, dtype=torch.float64)],
        [torch.tensor([1e-9, 1e-8, 1.0], dtype=torch.float64)],
    )
    gap = (
        adamw_weights(torch.zeros(3, dtype=torch.float64), left, [1e-3])
        - adamw_weights(torch.zeros(3, dtype=torch.float64), right, [1e-3])
    ).abs()
    bound = adam_gap_bound(left, right, [1e-3], BETAS, EPS)
    torch.testing.assert_close(bound, gap, rtol=1e-12, atol=0)
    torch.testing.assert_close(bound, 1e-3 * right[0] / (right[0] + EPS), rtol=1e-12, atol=0)
