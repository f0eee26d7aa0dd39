"""This process's stores, one per engine and directory, and reads of any block through them.

A block names its engine, so any process can read it with the store of that engine it
holds (a shared-memory file by its path, a Ray object by its reference); a Ray block is
released by the store that put it, which this process's registry finds again.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from tandem.dataplane.config import DataPlaneConfig
from tandem.dataplane.shm import ShmStore
from tandem.dataplane.store import Block, Store

_lock = threading.Lock()
_stores: dict[tuple[str, str], Store] = {}


def store_for(config: DataPlaneConfig) -> Store:
    """This process's store of ``config.engine`` (built on first use)."""
    key = (config.engine, config.directory if config.engine == "shm" else "")
    with _lock:
        if key not in _stores:
            if config.engine == "shm":
                _stores[key] = ShmStore(config.directory)
            else:
                # deferred: the Ray engine needs Ray, an optional dependency
                from tandem.dataplane.ray_store import RayStore

                _stores[key] = RayStore()
        return _stores[key]


def _reader(block: Block) -> Store:
    if block.engine == "shm":
        return _stores.get(("shm", "/dev/shm")) or store_for(DataPlaneConfig())
    return store_for(DataPlaneConfig(engine="ray"))


def get(block: Block, fields: Sequence[str], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """``fields`` of ``rows`` (sorted, unique) of ``block``, whichever engine holds it."""
    return _reader(block).get(block, fields, rows)


def release(block: Block) -> None:
    """Release ``block`` (a shared-memory file from any process on its host; a Ray block from
    the process that put it, elsewhere nothing)."""
    _reader(block).release(block)


def discard_all() -> int:
    """Delete the blocks this process's shared-memory stores wrote that are still there."""
    with _lock:
        stores = list(_stores.values())
    return sum(store.discard_all() for store in stores if isinstance(store, ShmStore))
