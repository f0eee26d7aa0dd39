"""Offloading a training engine's state and loading it back changes nothing about training.

The weights are given storage of their own (not memory-mapped from the checkpoint), so on the
CPU the offload frees it and the reload refills it, as on a GPU: the same tensors, with DDP's
gradient hooks, FSDP2's shards and the optimizer's references intact. The GPU tier repeats
this on CUDA.
"""

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig, offload
from tests.engine.conftest import random_batch
from tests.engine.workers import EngineWorker


def _two_steps(config: EngineConfig, offload_between: bool) -> dict[str, torch.Tensor]:
    batch = random_batch(0, batch=8)
    kwargs = {"config": config, "own_storage": True}
    with create_worker_group(EngineWorker, ResourcePool((2,)), "process", kwargs=kwargs) as group:
        group.train_step(batch)
        if offload_between:
            # after a forward-only pass, which leaves FSDP2's root gathered unless the engine reshards
            for held, sharded in group.offload_and_load(batch[:2]):
                assert held and not any(held)  # every parameter and moment was freed
                assert sharded  # ... and what was freed is the shards, not a gathered copy
        group.train_step(batch)
        return group.parameters()[0]


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])  # fsdp2 frees shards
def test_an_offload_round_trip_between_steps_changes_nothing(tiny_model_dir, strategy):
    config = EngineConfig(model_path=tiny_model_dir, lr=1e-2, strategy=strategy, micro_batch_size=4)
    kept = _two_steps(config, offload_between=False)
    moved = _two_steps(config, offload_between=True)
    assert kept.keys() == moved.keys()
    for name, tensor in kept.items():
        assert torch.equal(moved[name], tensor), name


def test_host_copies_split_storages_over_fixed_blocks_and_restore_them_exactly(monkeypatch):
    """Blocks of one size (so the page-locked cache, which rounds up to powers of two, wastes at
    most the last block's slack); a storage may straddle blocks, a shared one moves once."""
    monkeypatch.setattr(offload, "HOST_BLOCK_BYTES", 1000)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=gen) for n in (100, 700, 3, 250)]  # 4 bytes each: 4212 bytes
    view = tensors[1][10:20]  # shares the second storage
    expected = [t.clone() for t in tensors]
    copies = offload.HostCopies([*tensors, view])
    assert copies.nbytes == 4 * (100 + 700 + 3 + 250)
    assert all(offload.storage_of(t).nbytes() == 0 for t in tensors)
    copies.restore()
    for tensor, want in zip(tensors, expected, strict=True):
        assert torch.equal(tensor, want)
    assert torch.equal(view, expected[1][10:20])
