"""Offloading a training engine's state and loading it back changes nothing about training.

On the CPU the round trip moves nothing, but it runs the same code a GPU run does: FSDP2's
``Module.to`` path (its shards re-registered) and the optimizer state's moves, and it checks
the parameters stay the objects the optimizer trains. The GPU tier repeats this on CUDA.
"""

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig
from tests.engine.conftest import random_batch
from tests.engine.workers import EngineWorker


def _two_steps(config: EngineConfig, offload_between: bool) -> dict[str, torch.Tensor]:
    batch = random_batch(0, batch=8)
    with create_worker_group(EngineWorker, ResourcePool((2,)), "process", kwargs={"config": config}) as group:
        group.train_step(batch)
        if offload_between:
            group.offload_and_load()
        group.train_step(batch)
        return group.parameters()[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_an_offload_round_trip_between_steps_changes_nothing(tiny_model_dir, strategy):
    config = EngineConfig(model_path=tiny_model_dir, lr=1e-2, strategy=strategy, micro_batch_size=4)
    kept = _two_steps(config, offload_between=False)
    moved = _two_steps(config, offload_between=True)
    assert kept.keys() == moved.keys()
    for name, tensor in kept.items():
        assert torch.equal(moved[name], tensor), name
