"""The Ray engine on one node: round trips bit-exact for every dtype, through the local read and
through the gather task the engine runs on a block's node for a reader on another node."""

import numpy as np
import pytest
import torch

from tests.dataplane.test_store import DTYPES, bits, jagged


def test_ray_engine_needs_ray():
    pytest.importorskip("ray")
    import ray

    if ray.is_initialized():
        pytest.skip("Ray is connected in this process")
    from tandem.dataplane.ray_store import RayStore

    with pytest.raises(RuntimeError, match="dataplane.engine=ray needs a connected Ray"):
        RayStore()


def test_ray_round_trip_is_bit_exact_for_every_dtype_local_and_by_gather_task(ray_cluster):
    from tandem.dataplane.ray_store import RayStore, gather_rows, gathered_arrays
    from tandem.dataplane.store import decode_rows

    store = RayStore()
    gather = ray_cluster.remote(num_cpus=0)(gather_rows)
    for dtype in DTYPES:
        fields = {
            "tokens": jagged(dtype),
            "dense": jagged(dtype)[:, 0],
            "experts": jagged(dtype, trailing=(2, 3)),
        }
        block = store.put(fields)
        rows = np.array([1, 2, 4])
        local = store.get(block, list(fields), rows)
        compact = ray_cluster.get(
            gather.remote(block.columns, rows, *block.refs)
        )  # what a remote reader gets
        remote = decode_rows(block.columns, gathered_arrays(block.columns, compact), np.arange(3))
        for name, tensor in fields.items():
            assert torch.equal(bits(local[name]), bits(tensor[rows])), (dtype, name)
            assert torch.equal(bits(remote[name]), bits(tensor[rows])), (dtype, name)
        store.release(block)
    assert store.held_blocks == 0
