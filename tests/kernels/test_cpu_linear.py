"""oneDNN linear layers against ``F.linear`` (values and gradients), fallbacks, and the module swap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.cpu.linear import (
    CPULinear,
    PackedLinears,
    active_backend,
    cpu_linear_backend,
    linear,
    onednn_available,
    use_cpu_linears,
)
from tandem.models import TinyModelConfig, build_tiny_model

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 64), (3, 5, 64), (1, 64)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(
    "out_features", [48, 96]
)  # narrower and wider than the input: both weight-gradient paths
def test_values_and_gradients_match_f_linear(shape, with_bias, out_features):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    weight = torch.randn(out_features, 64, generator=gen, requires_grad=True)
    bias = torch.randn(out_features, generator=gen, requires_grad=True) if with_bias else None
    upstream = torch.randn(*shape[:-1], out_features, generator=gen)

    def run(fn):
        for t in (x, weight, bias):
            if t is not None:
                t.grad = None
        out = fn(x, weight, bias)
        out.backward(upstream)
        grads = [t.grad.clone() for t in (x, weight, bias) if t is not None]
        return out.detach(), grads

    with cpu_linear_backend("onednn"):
        out, grads = run(linear)
    ref_out, ref_grads = run(F.linear)
    assert out.shape == ref_out.shape
    assert relative_error(out, ref_out) < 1e-5
    for got, want in zip(grads, ref_grads, strict=True):
        assert relative_error(got, want) < 1e-5


@needs_onednn
def test_non_contiguous_input_and_frozen_weight():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, 10, generator=gen)
    x = base.t().requires_grad_()  # [10, 64], transposed strides
    weight = torch.randn(32, 64, generator=gen)  # frozen: only the input gets a gradient
    with cpu_linear_backend("onednn"):
        out = linear(x, weight)
        out.sum().backward()
    assert relative_error(out.detach(), F.linear(x.detach(), weight)) < 1e-5
    assert relative_error(x.grad, weight.sum(0).expand(10, 64)) < 1e-5


def test_falls_back_to_f_linear_where_onednn_does_not_apply():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(8, 16, generator=gen)
    cases = [
        torch.randn(4, 16, generator=gen).bfloat16(),  # not fp32
        torch.randn(0, 16),  # empty
    ]
    with cpu_linear_backend("onednn"):
        for x in cases:
            w = weight.to(x.dtype)
            assert torch.equal(linear(x, w), F.linear(x, w))
    with cpu_linear_backend("torch"):  # switched off: exactly F.linear
        x = torch.randn(4, 16, generator=gen)
        assert torch.equal(linear(x, weight), F.linear(x, weight))
        assert active_backend() == "torch"


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="backend='mkl'"), cpu_linear_backend("mkl"):
        pass


@needs_onednn
def test_swapped_model_keeps_its_state_and_matches_the_plain_model():
    config = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    plain = build_tiny_model(config, 50, 0, 1, 2)
    swapped = build_tiny_model(config, 50, 0, 1, 2)
    swapped.load_state_dict(plain.state_dict())
    count = use_cpu_linears(swapped)
    assert count == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + the head
    assert all(type(m) is not torch.nn.Linear for m in swapped.modules())
    assert isinstance(swapped.lm_head, CPULinear) and isinstance(swapped.lm_head, torch.nn.Linear)
    assert swapped.state_dict().keys() == plain.state_dict().keys()
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    with cpu_linear_backend("onednn"):
        loss = swapped(ids, labels=ids).loss
    ref_loss = plain(ids, labels=ids).loss
    assert abs(float(loss.detach()) - float(ref_loss.detach())) < 1e-5
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(swapped.named_parameters(), plain.parameters(), strict=True):
        assert relative_error(p.grad, q.grad) < 1e-4, name


@needs_onednn
def test_packed_linears_fuse_groups_and_match_plain_products():
    """Fused groups give each member's product; a fused member is not packed alone (its
    ``forward`` takes the plain weight); a layer outside the groups keeps its own packing."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {
            "q": torch.nn.Linear(32, 32),
            "k": torch.nn.Linear(32, 16, bias=False),
            "o": torch.nn.Linear(32, 32),
        }
    )
    packed = PackedLinears(model)
    group = (model["q"], model["k"])
    packed.fuse([group])
    assert len(packed) == 2  # the q/k group once, o alone
    x = torch.randn(5, 32)
    with torch.no_grad():
        fused = packed.forward_fused(group, x)
        assert fused is not None
        for module, out in zip(group, fused, strict=True):
            torch.testing.assert_close(out, module(x), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(packed.forward(module, x), module(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed.forward(model["o"], x), model["o"](x), atol=1e-5, rtol=1e-5)
        model["q"].weight.mul_(2.0)  # a weight update: refresh repacks the group
        packed.refresh()
        torch.testing.assert_close(packed.forward_fused(group, x)[0], model["q"](x), atol=1e-5, rtol=1e-5)
