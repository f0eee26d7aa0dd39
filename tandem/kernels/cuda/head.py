"""Products of half-precision matrices with fp32 sums and fp32 output, on tensor cores where possible.

A bf16 (or fp16) rollout model's head computes ``hidden.float() @ weight.float().T``: the
product of two half-precision values is exact in fp32, so what matters is that the sums run
in fp32. cuBLAS does exactly that when asked for fp32 output from half inputs
(``aten::mm.dtype``): the same logits up to summation order, without an fp32 copy of the
weight each step (0.5 GB for a 151,936 x 896 head) and on tensor cores rather than the fp32
units (an order of magnitude more FLOP/s on an H100). :func:`half_head_logits` is that, for
the rollout head (inference). :func:`half_matmul_fp32` is the same product for any two half
matrices, with the exact fallback elsewhere (upcast, fp32 product): the trainer's
``bfloat16`` log-prob head (:mod:`tandem.models.logprobs`) runs on it.
"""

from __future__ import annotations

import functools

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _fp32_output_matmul_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this PyTorch and GPU run half-precision products with fp32 output (tried once)."""
    try:
        probe = torch.ones(2, 2, dtype=dtype, device=device)
        return torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _tensor_core_fp32_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both half precision of one dtype on one CUDA device, and this PyTorch has the product."""
    return (
        a.is_cuda
        and a.dtype in HALF_DTYPES
        and b.dtype == a.dtype
        and b.device == a.device
        and _fp32_output_matmul_works(a.device, a.dtype)
    )


def half_matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [n, k] @ b [k, m]`` of two half-precision matrices (same dtype) as fp32 ``[n, m]``:
    exact products, fp32 sums. On CUDA one tensor-core product with fp32 output; elsewhere (or
    where this PyTorch lacks it) the same numbers from fp32 copies (summation order aside)."""
    if _tensor_core_fp32_applies(a, b):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def half_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``hidden [B, d]`` and ``weight [V, d]``, both bf16 or both fp16 on one CUDA device ->
    fp32 logits ``[B, V]``; ``None`` where the tensor-core product does not apply (the caller
    keeps its own fp32 path, e.g. the CPU's prepacked head)."""
    return half_matmul_fp32(hidden, weight.t()) if _tensor_core_fp32_applies(hidden, weight) else None
