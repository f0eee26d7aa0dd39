"""Named tensors (HF parameter names): reading them from a model directory, loading them into a model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

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


def read_hf_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs saved in an HF model directory (``*.safetensors``, else ``*.bin``).

    Raises ``FileNotFoundError`` naming the directory when it holds no weight files.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no weights at {path}: not a directory")
    safetensors_files = sorted(path.glob("*.safetensors"))
    if safetensors_files:
        from safetensors import safe_open

        for file in safetensors_files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, handle.get_tensor(name)
        return
    bin_files = sorted(path.glob("pytorch_model*.bin"))
    if not bin_files:
        raise FileNotFoundError(f"no weights at {path}: no *.safetensors or pytorch_model*.bin files")
    for file in bin_files:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()
