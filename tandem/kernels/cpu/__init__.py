"""The CPU speed work, in one package, switched on only for models that compute on the CPU.

* :mod:`~tandem.kernels.cpu.linear` — fp32 linear layers on oneDNN (and prepacked weights
  for inference);
* :mod:`~tandem.kernels.cpu.allocator` — glibc ``malloc`` settings that recycle activation
  memory instead of faulting in new pages each step (process-wide);
* :mod:`~tandem.kernels.cpu.attention` — causal attention of short fp32 sequences as
  batched products (taken per call, only for CPU tensors).

:func:`enable_cpu_kernels` is what the training and rollout engines call: it does nothing
unless the device is the CPU (:func:`tandem.device.uses_cpu_kernels`), so a GPU run never
changes the process's allocator or its models' linear layers. Each kernel is tested
against the plain PyTorch path it replaces (``tests/kernels``).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.device import uses_cpu_kernels
from tandem.kernels.cpu.allocator import tune_cpu_allocator
from tandem.kernels.cpu.linear import use_cpu_linears


def enable_cpu_kernels(model: nn.Module, device: torch.device | str) -> bool:
    """On the CPU: tune the allocator (once per process) and route ``model``'s linear layers
    through oneDNN; elsewhere nothing. Returns whether the kernels were switched on."""
    if not uses_cpu_kernels(device):
        return False
    tune_cpu_allocator()
    use_cpu_linears(model)
    return True
