"""The data plane: per-token data stays in a store on the node that produced it; the controller
holds :class:`BatchRef` s (references plus per-row scalars). See docs/data-plane.md."""

from tandem.dataplane.batch_ref import BatchRef, FieldSchema, RefPart
from tandem.dataplane.config import DataPlaneConfig
from tandem.dataplane.process_stores import discard_all, get, release, store_for
from tandem.dataplane.shm import ShmBlock, ShmStore
from tandem.dataplane.store import Block, Store, Traffic, traffic

__all__ = [
    "BatchRef",
    "Block",
    "DataPlaneConfig",
    "FieldSchema",
    "RefPart",
    "ShmBlock",
    "ShmStore",
    "Store",
    "Traffic",
    "discard_all",
    "get",
    "release",
    "store_for",
    "traffic",
]
