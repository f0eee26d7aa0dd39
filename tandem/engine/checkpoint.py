"""Engine checkpoints with torch.distributed.checkpoint: sharded-aware, written atomically.

Model and optimizer go through DCP (each rank writes its shards, so FSDP2 never gathers a
full copy); scheduler, step and RNG states go to a small per-rank file. Everything is
written to ``<path>.tmp`` and renamed into place by rank 0 once every rank has finished,
so a crash mid-write leaves any previous checkpoint at ``path`` intact.

DCP records each tensor's global shape and where its shards lie, so a checkpoint saved on
one mesh loads on another (tensor-parallel DTensors, FSDP2 shards, plain tensors, in any
combination): each rank reads the pieces its own shards cover. A rank that the saving run
did not have resumes with rank 0's small file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns that it assumes a single process when no process group exists; that is the intent here."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save_engine_state(
    path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any]
) -> None:
    final = Path(path)
    staging = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    model_state, optim_state = get_state_dict(module, optimizer)
    with _quiet_single_process():
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(staging / "dcp"))
    torch.save(extra, staging / f"extra_rank{_rank()}.pt")
    _barrier()
    if _rank() == 0:
        previous = final.with_name(final.name + ".old")
        if final.exists():
            final.rename(previous)
        staging.rename(final)
        shutil.rmtree(previous, ignore_errors=True)
    _barrier()


def load_engine_state(
    path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    root = Path(path)
    if not (root / "dcp").exists():
        raise FileNotFoundError(f"no engine checkpoint at {root} (missing {root / 'dcp'})")
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(root / "dcp"))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    extra = root / f"extra_rank{_rank()}.pt"
    if not extra.exists():  # saved by fewer ranks (another mesh): rank 0's schedule, step and RNG
        extra = root / "extra_rank0.pt"
    return torch.load(extra, weights_only=False)
