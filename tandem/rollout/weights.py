"""Loading named tensors (HF parameter names) into a model in place."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def load_named_tensors(model: torch.nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each ``(name, tensor)`` into the model's parameter or buffer of that name; returns how many.

    Tied weights (embedding and head) share storage, so loading either name updates both.
    Unknown names and shape mismatches are errors naming the tensor.
    """
    targets = dict(model.state_dict(keep_vars=True))
    loaded = 0
    for name, tensor in named_tensors:
        target = targets.get(name)
        if target is None:
            raise KeyError(f"weight {name!r} is not a parameter of this model (e.g. {next(iter(targets))!r})")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
            )
        target.data.copy_(tensor.to(device=target.device, dtype=target.dtype))
        loaded += 1
    return loaded
