"""What a training step hands back from its micro-batches: the losses and metrics read back in
one transfer, and the forward-only outputs put back in the batch's row order."""

from __future__ import annotations

import torch

from tandem.engine.base import TokenOutputs


def read_back(
    losses: list[torch.Tensor], metrics: dict[str, list[torch.Tensor | float]]
) -> tuple[float, dict[str, list[float]]]:
    """The micro-batches' losses summed in order and each metric's values as floats, with one
    device-to-host transfer for every tensor among them (in float64: each reads back exactly)."""
    values = [*losses, *(value for listed in metrics.values() for value in listed)]
    tensors = [value.detach().double().reshape(()) for value in values if isinstance(value, torch.Tensor)]
    device = tensors[0].device if tensors else None
    read = iter(torch.stack([t.to(device) for t in tensors]).tolist() if tensors else ())
    floats = [next(read) if isinstance(value, torch.Tensor) else float(value) for value in values]
    loss = 0.0
    for value in floats[: len(losses)]:
        loss += value
    rest = iter(floats[len(losses) :])
    return loss, {name: [next(rest) for _ in listed] for name, listed in metrics.items()}


def _reassembled_dtype(values: torch.Tensor) -> torch.dtype:
    """float32 for every floating-point output (whatever the compute dtype), the type itself else."""
    return torch.float32 if values.is_floating_point() else values.dtype


def reassemble(collected: list[tuple[list[int], TokenOutputs]], shape: torch.Size) -> TokenOutputs:
    """The micro-batches' outputs (any device) in the batch's row order, on the CPU: ``[B, S, ...]``
    each, float32 (token ids keep their integer type)."""
    first = collected[0][1].fields() if collected else {}
    whole = {
        name: torch.zeros(*shape, *values.shape[2:], dtype=_reassembled_dtype(values))
        for name, values in first.items()
    }
    for rows, outputs in collected:
        index = torch.tensor(rows)
        for name, values in outputs.fields().items():
            whole[name][index] = values.to(whole[name].device, whole[name].dtype)
    return TokenOutputs(**whole)
