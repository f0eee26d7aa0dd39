"""Sequence x tensor parallelism on the ``(dp, sp, tp)`` mesh, and LoRA under tensor parallelism:
gloo processes against one process computing the same batch whole (outputs, loss, every
trainable gradient, the merged weights a rollout receives); :class:`ParallelDims`' arithmetic
against the torch mesh's layout."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig, LoraConfig
from tandem.engine.parallel_dims import MESH_DIMS, ParallelDims
from tandem.engine.ulysses_attention import check_heads
from tandem.models import TinyModelConfig, save_tiny_model
from tests.engine.conftest import random_batch
from tests.engine.mesh_comparisons import (
    assert_same_gradients,
    assert_same_step,
    assert_within_tolerance,
    export_and_sync_diffs,
    mesh_config,
    mesh_groups,
    train_step,
)
from tests.engine.tensor_parallel_workers import TensorParallelWorker

LORA = LoraConfig(rank=4, alpha=8)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """4 query and 2 key/value heads: over ``tp=2`` one key/value head a rank, repeated for its
    two ``sp`` ranks; 8 and 4 (hidden 128): two a rank, split over ``sp``; a Qwen3 (per-head norms)."""
    root = tmp_path_factory.mktemp("sp_tp")
    sizes = {
        "qwen2": TinyModelConfig(family="qwen2", num_heads=4, num_kv_heads=2),
        "qwen2-8-heads": TinyModelConfig(family="qwen2", num_heads=8, num_kv_heads=4),
        "qwen3": TinyModelConfig(family="qwen3", num_heads=4, num_kv_heads=2),
    }
    return {key: str(save_tiny_model(root / key, size)) for key, size in sizes.items()}


one_process, two_ranks, _ = mesh_groups(TensorParallelWorker, "tensor-parallel")


@pytest.fixture(scope="module")
def four_ranks():
    with create_worker_group(TensorParallelWorker, ResourcePool((4,)), "process") as group:
        yield group


# ---------------------------------------------------------------- arithmetic, no process group
def test_parallel_dims_coordinates_follow_the_row_major_mesh():
    """Rank ``(d * sp + s) * tp + t``: the same places ``init_device_mesh``'s ``arange(W).view(dp, sp, tp)`` gives."""
    dims = ParallelDims(world=12, sp=2, tp=3)
    assert (dims.dp, dims.gradient_ranks) == (2, 4)
    layout = torch.arange(12).view(dims.dp, dims.sp, dims.tp)
    for rank in range(12):
        assert layout[dims.coordinates(rank)] == rank
    assert MESH_DIMS == ("dp", "sp", "tp")


@pytest.mark.parametrize(
    "dims,message",
    [
        (ParallelDims(6, sp=4), "engine.sp_size=4 must divide the world size 6"),
        (ParallelDims(6, tp=4), "engine.tp_size=4 must divide the world size 6: each data-parallel rank"),
        (ParallelDims(6, sp=2, tp=2), "engine.sp_size=2 x engine.tp_size=2 = 4 must divide the world size 6"),
        (ParallelDims(4, tp=2, ep=4), "engine.ep_size=4 must divide the 2 data-parallel ranks"),
    ],
    ids=["sp", "tp", "sp-x-tp", "ep"],
)
def test_parallel_dims_refuse_a_world_that_does_not_divide(dims, message):
    with pytest.raises(ValueError, match=message):
        dims.check()


@pytest.mark.parametrize(
    "heads,kv_heads,message",
    [
        (6, 2, r"engine.sp_size=2 x engine.tp_size=2 = 4 must divide the model's num_attention_heads=6"),
        (12, 6, r"engine.sp_size=2 x engine.tp_size=2 and the model's num_key_value_heads=6: each tensor-parallel rank holds 3"),
    ],
    ids=["query-heads", "kv-heads"],
)  # fmt: skip
def test_heads_that_sp_x_tp_cannot_split_are_refused_naming_both_keys(heads, kv_heads, message):
    with pytest.raises(ValueError, match=message):
        check_heads(heads, kv_heads, sp_size=2, tp_size=2)
    check_heads(8, 2, sp_size=2, tp_size=2)  # one key/value head a tp rank: repeated for its sp ranks


def test_config_takes_sp_x_tp_and_tp_with_lora():
    EngineConfig(tp_size=2, sp_size=2, strategy="fsdp2", lora=LORA)


# ---------------------------------------------------------------- TP with LoRA: two ranks
@pytest.mark.parametrize("strategy", ["single", "fsdp2"])
def test_lora_over_two_tensor_parallel_ranks_equals_one_process(model_dirs, one_process, two_ranks, strategy):
    """Outputs, loss and every adapter's gradient (the colwise layers' ``B`` and rowwise layers'
    ``A`` split, the others replicated) of a LoRA policy split over ``tp=2``."""
    batch = random_batch(0, batch=6, length=24)
    config = mesh_config(model_dirs["qwen3"], lora=LORA)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    assert whole["grads"] and all(".lora_" in name for name in whole["grads"])
    two_ranks.build(dataclasses.replace(config, tp_size=2, strategy=strategy))
    assert_same_gradients(two_ranks.gradients(batch), whole)


def test_lora_tensor_parallel_step_and_merged_weights_equal_one_process(
    model_dirs, one_process, two_ranks, tmp_path
):
    """After one optimizer step (adapters initialised non-zero by the step), the merged weights
    a rollout receives (weight-sync buckets, HF export) equal the one-process merge."""
    batch = random_batch(5, batch=8, length=24)
    config = mesh_config(model_dirs["qwen2"], lora=LORA)
    one_process.build(config)
    split = dataclasses.replace(config, tp_size=2, strategy="fsdp2")
    diffs, exported = export_and_sync_diffs(one_process, two_ranks, split, batch, tmp_path)
    assert not any("lora" in name for name in exported)
    assert_within_tolerance(diffs)


# ---------------------------------------------------------------- SP x TP: four ranks
@pytest.mark.slow  # four processes start on a 2-core machine
@pytest.mark.parametrize(
    "model,overrides",
    [("qwen2", {}), ("qwen2-8-heads", {}), ("qwen3", {"lora": LORA})],
    ids=["repeated-kv", "split-kv", "qwen3-lora"],
)
def test_sp_x_tp_ranks_equal_one_process(model_dirs, one_process, four_ranks, model, overrides):
    """``(dp, sp, tp) = (1, 2, 2)``: Ulysses over each tensor-parallel rank's heads, weights
    split over ``tp``, gradients reduced over ``sp`` by FSDP2."""
    batch = random_batch(0, batch=6, length=24)
    config = mesh_config(model_dirs[model], **overrides)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    four_ranks.build(dataclasses.replace(config, sp_size=2, tp_size=2, strategy="fsdp2"))
    assert_same_gradients(four_ranks.gradients(batch), whole)


@pytest.mark.slow
def test_sp_x_tp_optimizer_step_equals_one_process(model_dirs, one_process, four_ranks):
    """One clipped optimizer step on the ``(1, 2, 2)`` mesh: outputs, grad norm, loss, updated weights."""
    batch = random_batch(2, batch=8, length=24)
    config = mesh_config(model_dirs["qwen2"], grad_clip=0.5)
    one_process.build(config)
    whole = train_step(one_process, batch)
    four_ranks.build(dataclasses.replace(config, sp_size=2, tp_size=2, strategy="fsdp2"))
    assert_same_step(train_step(four_ranks, batch), whole)
