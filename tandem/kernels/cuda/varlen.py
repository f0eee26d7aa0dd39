"""Flash-attention's variable-length kernel for packed rows on CUDA.

Two providers, the first one importable wins:

* ``flash-attn`` — the package's ``flash_attn_varlen_func``;
* ``torch`` — ``torch.nn.attention.varlen.varlen_attn``, which PyTorch ships (2.10 and later)
  over the same kernels.

Both take the sequences unpadded, one after another (``q [Q, H, d]``, ``k, v [K, H_kv, d]``
with cumulative lengths ``cu_q``, ``cu_k``), and both align the causal mask to the bottom
right when a sequence has fewer queries than keys: query ``i`` of ``L_q`` sees keys
``0 .. L_k - L_q + i``. That is the :class:`~tandem.engine.causal_attention.QueryOffsets`
layout of a response that reads a shared prompt. The kernels run on CUDA in fp16/bf16 only
(:func:`varlen_kernel_for` says ``None`` elsewhere, and the caller keeps its SDPA path).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class VarlenKernel:
    """``run(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p) -> [Q, H, d]``, causal.

    Attributes:
        provider: ``flash-attn`` or ``torch``.
        run: the call, with the contract of the module docstring.
        dropout: whether the provider can apply attention dropout.
        any_scale: whether it takes a softmax scale other than ``d ** -0.5``.
    """

    provider: str
    run: Callable[..., torch.Tensor]
    dropout: bool
    any_scale: bool = True


def _flash_attn_package() -> VarlenKernel | None:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p):
        return flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=dropout_p, softmax_scale=scale, causal=True
        )

    return VarlenKernel("flash-attn", run, dropout=True)


def _torch_varlen() -> VarlenKernel | None:
    """PyTorch's kernel. Its keywords changed between releases (``is_causal`` became
    ``window_size``; ``scale`` and ``enable_gqa`` came later): ask its signature."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    accepted = set(inspect.signature(varlen_attn).parameters)
    if "window_size" in accepted:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in accepted:
        causal = {"is_causal": True}
    else:
        return None

    def run(q, k, v, cu_q, cu_k, max_q, max_k, scale, dropout_p):
        options = dict(causal)
        if "scale" in accepted:
            options["scale"] = scale
        group = q.shape[1] // k.shape[1]
        if group > 1 and "enable_gqa" in accepted:
            options["enable_gqa"] = True
        elif group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **options)

    return VarlenKernel("torch", run, dropout=False, any_scale="scale" in accepted)


@functools.cache
def installed_varlen_kernel() -> VarlenKernel | None:
    """The first provider that imports (flash-attn, then PyTorch), or ``None``."""
    return _flash_attn_package() or _torch_varlen()


def varlen_kernel_for(query: torch.Tensor, dropout_p: float, scale: float | None) -> VarlenKernel | None:
    """The varlen kernel for ``query [..., d]``, or ``None`` when it does not apply: not on
    CUDA, not fp16/bf16, a head wider than 256, none installed, or a dropout or softmax
    scale that the provider cannot take."""
    dim = query.shape[-1]
    if not query.is_cuda or query.dtype not in HALF_DTYPES or dim > MAX_HEAD_DIM:
        return None
    kernel = installed_varlen_kernel()
    if kernel is None or (dropout_p and not kernel.dropout):
        return None
    if not kernel.any_scale and scale is not None and abs(scale - dim**-0.5) > 1e-12:
        return None
    return kernel
