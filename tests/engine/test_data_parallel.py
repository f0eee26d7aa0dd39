"""A 2-process gloo data-parallel step (DDP and FSDP2) equals the single-process step on the same global batch."""

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig, LoraConfig
from tests.engine.conftest import random_batch
from tests.engine.workers import EngineWorker


def run(config: EngineConfig, world: int, batch):
    with create_worker_group(
        EngineWorker, ResourcePool((world,)), "process", kwargs={"config": config}
    ) as group:
        out = group.train_step(batch)
        return out, group.parameters()[0]


@pytest.mark.parametrize(
    "strategy,packing",
    [("ddp", True), ("fsdp2", True), pytest.param("fsdp2", False, marks=pytest.mark.slow)],  # padded: slow
)
def test_two_process_step_equals_single_process(tiny_model_dir, strategy, packing):
    batch = random_batch(0, batch=8)
    # A large Adam eps keeps the first update smooth in the gradient: with eps=1e-8 the first Adam
    # step is ~lr * sign(g), which turns float-rounding differences of near-zero gradients into lr-sized ones.
    base = EngineConfig(
        model_path=tiny_model_dir,
        lr=1e-2,
        eps=1e-3,
        use_packing=packing,
        max_tokens_per_micro_batch=48,
        micro_batch_size=3,
    )
    single_out, single_params = run(base, 1, batch)
    dp_out, dp_params = run(EngineConfig(**{**base.__dict__, "strategy": strategy}), 2, batch)
    torch.testing.assert_close(dp_out["log_probs"], single_out["log_probs"], atol=1e-6, rtol=1e-5)
    # Every rank reports the same global grad norm, equal to the single-process one.
    torch.testing.assert_close(dp_out["grad_norm"], single_out["grad_norm"], atol=1e-6, rtol=1e-5)
    # Loss shares of the two ranks add up to the single-process loss.
    assert abs(float(dp_out["loss"][0] + dp_out["loss"][-1]) - float(single_out["loss"][0])) < 1e-5
    assert single_params.keys() == dp_params.keys()
    for name in single_params:
        torch.testing.assert_close(dp_params[name], single_params[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("strategy", ["fsdp2"])
def test_unequal_shards_keep_collectives_in_step(tiny_model_dir, strategy):
    """Rank 0 needs three micro-batches, rank 1 has one sequence: it runs empty passes and nothing hangs."""
    batch = random_batch(3, batch=4, length=24, left_pad_rows=0)
    mask = (
        torch.arange(24) < torch.tensor([24, 20, 18, 5])[:, None]
    ).long()  # no two of the first three fit in 24
    batch = batch.assign(
        tensors={"attention_mask": mask, "input_ids": batch["input_ids"] * mask, "loss_mask": mask}
    )
    shards = [batch[:3], batch[3:]]
    config = EngineConfig(
        model_path=tiny_model_dir, lr=1e-2, eps=1e-3, max_tokens_per_micro_batch=24, strategy=strategy
    )
    single = EngineConfig(**{**config.__dict__, "strategy": "single"})
    with create_worker_group(EngineWorker, ResourcePool((2,)), "process", kwargs={"config": config}) as group:
        assert group.train_step_on_shard(shards) == [3, 3]
        dp_params = group.parameters()[0]
    _, single_params = run(single, 1, batch)
    for name, tensor in single_params.items():
        torch.testing.assert_close(dp_params[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def test_lora_under_fsdp2_merges_whole_weights_like_one_process(tiny_model_dir):
    """The merged weights a rollout engine receives: gathered from the shards, adapters merged,
    with no autograd history (they cross process boundaries), equal to one process's."""
    batch = random_batch(0, batch=8)
    base = EngineConfig(
        model_path=tiny_model_dir, lr=1e-2, eps=1e-3, micro_batch_size=4, lora=LoraConfig(rank=4, alpha=8)
    )
    _, single_params = run(base, 1, batch)
    _, sharded_params = run(EngineConfig(**{**base.__dict__, "strategy": "fsdp2"}), 2, batch)
    assert single_params.keys() == sharded_params.keys() and not any(".lora_" in n for n in single_params)
    for name, tensor in single_params.items():
        torch.testing.assert_close(sharded_params[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
