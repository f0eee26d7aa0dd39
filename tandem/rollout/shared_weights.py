"""A rollout model whose parameters are the trainer's own tensors: one copy of the weights, not two.

In colocated sync training the rollout engine and the actor live in one process, on one device,
and never compute at the same time. :func:`share_named_tensors` makes the rollout model's
parameters the trainer's tensors themselves (no copy), so the optimizer's in-place step updates
both; a weight sync then has nothing left to copy (:func:`load_unshared`). A tensor that cannot be
shared (another shape, dtype or device; a DTensor shard's gathered copy; a merged LoRA weight is
shared as the fresh tensor it is) is copied in as before, so the model's values always equal
the given ones, shared or not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from tandem.models.weights import load_named_tensors

_PLAIN = (torch.Tensor, nn.Parameter)


def _same_layout(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    return (
        type(tensor) in _PLAIN
        and type(target) in _PLAIN
        and tensor.shape == target.shape
        and tensor.dtype == target.dtype
        and tensor.device == target.device
    )


def _is_same_memory(target: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether ``target`` already is ``tensor`` (same storage, offset and strides)."""
    return (
        _same_layout(target, tensor)
        and target.data_ptr() == tensor.data_ptr()
        and target.stride() == tensor.stride()
    )


def share_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Make each parameter of ``model`` named in ``named_tensors`` (HF names) that very tensor where
    its shape, dtype and device match (a frozen ``nn.Parameter`` over the same memory); copy the
    others in (:func:`~tandem.models.weights.load_named_tensors`). Returns how many are shared.

    Tied parameters (embedding and head) stay tied: every module slot that held the old
    parameter gets the new one. The model's old tensors are freed once nothing else holds them.
    """
    targets = dict(model.state_dict(keep_vars=True))
    replacements: dict[int, nn.Parameter] = {}
    copies: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named_tensors:
        target = targets.get(name)
        if isinstance(target, nn.Parameter) and _same_layout(target, tensor):
            replacements[id(target)] = nn.Parameter(tensor.detach(), requires_grad=False)
        else:  # unknown names and shape mismatches are refused there, by name
            copies.append((name, tensor))
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is not None and id(param) in replacements:
                module._parameters[key] = replacements[id(param)]
    load_named_tensors(model, copies)
    return len(replacements)


def load_unshared(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy into ``model`` each ``(name, tensor)`` that is not already its own parameter or buffer of
    that name (a shared tensor needs no copy: copying it onto itself only costs time); returns how
    many pairs were given, shared or copied (what a weight update reports as loaded)."""
    targets = dict(model.state_dict(keep_vars=True))
    given = 0

    def copies() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal given
        for name, tensor in named_tensors:
            given += 1
            target = targets.get(name)
            if target is None or not _is_same_memory(target, tensor):
                yield name, tensor

    load_named_tensors(model, copies())
    return given
