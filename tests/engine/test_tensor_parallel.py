"""Tensor parallelism: gloo processes splitting every layer's weights over ``tp`` ranks compute
what one process computes whole (outputs, loss, every gradient, a step's weights); checkpoints
move between meshes; exports and weight syncs see whole tensors; the vocabulary-parallel
softmax against ``torch.log_softmax`` of the whole logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.controller import ResourcePool, WorkerError, create_worker_group
from tandem.engine import EngineConfig
from tandem.engine.parallel_dims import ParallelDims
from tandem.engine.tensor_parallel import check_tensor_parallel_fits
from tandem.models import TinyModelConfig, build_tiny_model, save_tiny_model
from tandem.sft.config import SFTConfig, SFTTrainerConfig
from tandem.sft.data import SFTDataConfig
from tests.engine.conftest import random_batch
from tests.engine.mesh_comparisons import (
    assert_same_gradients,
    assert_same_step,
    assert_within_tolerance,
    export_and_sync_diffs,
    max_diff,
    mesh_config,
    mesh_groups,
    resumed_steps,
    train_step,
)
from tests.engine.tensor_parallel_workers import TensorParallelWorker


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny models with 4 query and 2 key/value heads (both split over 2 ranks; the character
    vocabulary's 103 rows split 52 + 51), a tied-embedding Llama, a Qwen3 (per-head norms), and
    one whose single key/value head 2 ranks cannot split."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    sizes = {
        "qwen2": TinyModelConfig(family="qwen2", num_heads=4, num_kv_heads=2),
        "llama-tied": TinyModelConfig(family="llama", num_heads=4, num_kv_heads=2, tie_word_embeddings=True),
        "qwen3": TinyModelConfig(family="qwen3", num_heads=4, num_kv_heads=2),
        "one kv head": TinyModelConfig(family="qwen2", num_heads=4, num_kv_heads=1),
    }
    return {key: str(save_tiny_model(root / key.replace(" ", "-"), size)) for key, size in sizes.items()}


one_process, two_ranks, gpu_groups = mesh_groups(TensorParallelWorker, "tensor-parallel")


@pytest.mark.parametrize(
    "model,overrides,strategy",
    [
        ("qwen2", {}, "single"),
        ("qwen2", {}, "fsdp2"),
        ("llama-tied", {}, "fsdp2"),
        ("qwen3", {"gradient_checkpointing": True}, "single"),
        ("qwen2", {"use_packing": False, "micro_batch_size": 4}, "single"),
        ("qwen2", {"head": "value"}, "fsdp2"),
        ("llama-tied", {"head": "reward"}, "single"),
    ],
    ids=["single", "fsdp2", "llama-tied-fsdp2", "qwen3-checkpointing", "padded", "value-head", "reward-head"],
)
def test_two_tensor_parallel_ranks_equal_one_process(
    model_dirs, one_process, two_ranks, model, overrides, strategy
):
    batch = random_batch(0, batch=6, length=24)
    config = mesh_config(model_dirs[model], **overrides)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    two_ranks.build(dataclasses.replace(config, tp_size=2, strategy=strategy))
    assert_same_gradients(two_ranks.gradients(batch), whole)


@pytest.mark.parametrize(
    "head,outputs", [("lm", ("log_probs", "entropy")), ("value", ("values",))], ids=["policy", "critic"]
)
def test_tensor_parallel_optimizer_step_equals_one_process(model_dirs, one_process, two_ranks, head, outputs):
    """grad norm (clipped: grad_clip below the norm), loss and the updated weights; the policy,
    and a critic, whose value head (replicated, like the norms) reads the whole hidden state."""
    batch = random_batch(2, batch=8, length=24)
    config = mesh_config(model_dirs["qwen2"], grad_clip=0.5, head=head)
    one_process.build(config)
    whole = train_step(one_process, batch)
    two_ranks.build(dataclasses.replace(config, tp_size=2, strategy="fsdp2"))
    assert_same_step(train_step(two_ranks, batch), whole, outputs=outputs)


@pytest.mark.slow  # four processes start on a 2-core machine
def test_fsdp2_by_tensor_parallel_mesh_step_equals_one_process(model_dirs, one_process):
    """Four ranks, ``(dp, tp) = (2, 2)``: FSDP2 over ``dp`` of the tensor-parallel shards."""
    batch = random_batch(2, batch=8, length=24)
    config = mesh_config(model_dirs["qwen2"])
    one_process.build(config)
    whole = train_step(one_process, batch)
    with create_worker_group(TensorParallelWorker, ResourcePool((4,)), "process") as group:
        group.build(dataclasses.replace(config, tp_size=2, strategy="fsdp2"))
        split = train_step(group, batch)
    assert_same_step(split, whole, dp_size=2)


@pytest.mark.parametrize("saved_tp,resumed_tp", [(2, 1), (1, 2)])
def test_checkpoint_resumes_on_another_mesh(
    model_dirs, one_process, two_ranks, tmp_path, saved_tp, resumed_tp
):
    """A checkpoint saved under one ``tp_size`` and resumed under another trains on exactly as
    it does resumed under the mesh that saved it."""
    groups = {1: one_process, 2: two_ranks}
    config = mesh_config(model_dirs["qwen2"])
    configs = {1: config, 2: dataclasses.replace(config, tp_size=2, strategy="fsdp2")}
    first, second = random_batch(3, batch=8, length=24), random_batch(4, batch=8, length=24)
    resumed = resumed_steps(groups, configs, saved_tp, resumed_tp, first, second, tmp_path)
    assert_same_step(resumed[2], resumed[1])


def test_export_and_weight_sync_give_whole_tensors(model_dirs, one_process, two_ranks, tmp_path):
    """After one step, the HF export and the weight-sync buckets of a tp=2 engine hold the
    whole tensors of the one-process engine's weights, gathered one at a time."""
    batch = random_batch(5, batch=8, length=24)
    config = mesh_config(model_dirs["qwen2"])
    one_process.build(config)
    split = dataclasses.replace(config, tp_size=2, strategy="fsdp2")
    diffs, _ = export_and_sync_diffs(one_process, two_ranks, split, batch, tmp_path)
    assert_within_tolerance(diffs)


def test_vocab_parallel_softmax_equals_whole_log_softmax(two_ranks):
    """Log-probs, entropy, sum of squared probabilities and the logits' gradient from two
    vocabulary shards (uneven: 103 = 52 + 51) against ``torch.log_softmax`` of the whole logits."""
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 9, 103
    inputs = {
        "logits": torch.randn(rows, vocab, generator=gen) * 3,
        "labels": torch.randint(0, vocab, (rows,), generator=gen),
        "up_log_probs": torch.randn(rows, generator=gen),
        "up_entropy": torch.randn(rows, generator=gen),
    }
    inputs["labels"][:2] = torch.tensor([0, vocab - 1])  # the first and last rows of the vocabulary
    logits = inputs["logits"].clone().requires_grad_()
    log_softmax = torch.log_softmax(logits, dim=-1)
    probs = log_softmax.exp()
    log_probs = log_softmax.gather(-1, inputs["labels"].unsqueeze(-1)).squeeze(-1)
    entropy = -(probs * log_softmax).sum(-1)
    ((log_probs * inputs["up_log_probs"]).sum() + (entropy * inputs["up_entropy"]).sum()).backward()
    expected = {
        "log_probs": log_probs.detach(),
        "entropy": entropy.detach(),
        "sum_pi_squared": probs.detach().square().sum(-1),
    }
    diffs = {}
    for rank, got in enumerate(two_ranks.vocab_parallel(inputs)):
        shard = slice(0, 52) if rank == 0 else slice(52, vocab)
        diffs |= {f"rank{rank}/{name}": max_diff(got[name], value) for name, value in expected.items()}
        diffs[f"rank{rank}/grad"] = max_diff(got["grad"], logits.grad[:, shard])
    assert_within_tolerance(diffs, 1e-6)


@pytest.mark.parametrize(
    "model,overrides,message",
    [
        ("qwen2", {"tp_size": 3}, "engine.tp_size=3 must divide the world size 2"),
        (
            "one kv head",
            {"tp_size": 2},
            "engine.tp_size=2 must divide the model's num_attention_heads=4 and num_key_value_heads=1",
        ),
    ],
    ids=["world-size", "kv-heads"],
)
def test_a_tensor_parallel_mesh_that_does_not_fit_is_refused(
    model_dirs, two_ranks, model, overrides, message
):
    with pytest.raises(WorkerError, match=message):
        two_ranks.build(mesh_config(model_dirs[model], strategy="fsdp2", **overrides))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"strategy": "ddp"}, "engine.tp_size=2 with engine.strategy=ddp: the split weights are DTensors"),
        ({"strategy": "ddp", "sp_size": 2}, "engine.tp_size=2 with engine.strategy=ddp"),
    ],
    ids=["ddp", "ddp-with-sp"],
)
def test_config_refuses_what_tensor_parallelism_does_not_combine_with(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(tp_size=2, **overrides)


def test_layers_tensor_parallelism_does_not_plan_are_refused():
    """Every decoder layer is checked: a dense layer whose MLP projection is not a linear layer
    is refused (a mixture-of-experts block is planned: it stays whole)."""
    model = build_tiny_model(TinyModelConfig(family="qwen2", num_layers=2), 103, 0, 1, 2)
    check_tensor_parallel_fits(build_tiny_model(TinyModelConfig(family="qwen2_moe"), 103, 0, 1, 2), 2)
    model.model.layers[1].mlp.gate_proj = torch.nn.Identity()
    with pytest.raises(
        ValueError, match="engine.tp_size=2: the model's decoder layers have no linear mlp.gate_proj"
    ):
        check_tensor_parallel_fits(model, 2)


@pytest.mark.parametrize(
    "strategy,workers,message",
    [
        ("fsdp2", 3, "engine.tp_size=2 must divide the 3 workers: each data-parallel rank is tp_size workers"),
        ("single", 4, "engine.tp_size=2 with engine.strategy=single trains one tensor-parallel group, but the 4 "
         "workers form 2: set engine.strategy=fsdp2"),
    ],
    ids=["workers", "single-over-groups"],
)  # fmt: skip
def test_a_trainer_whose_workers_do_not_fit_the_tensor_parallel_size_is_refused(strategy, workers, message):
    engine = EngineConfig(tp_size=2, strategy=strategy)
    trainer = SFTTrainerConfig(n_workers=workers, global_batch_size=12)
    with pytest.raises(ValueError, match=message):
        SFTConfig(
            model_path="model", data=SFTDataConfig(train_path="rows.jsonl"), engine=engine, trainer=trainer
        )
    SFTConfig(  # one group trains under single; fsdp2 over any number of groups
        model_path="model", data=SFTDataConfig(train_path="rows.jsonl"), engine=engine,
        trainer=SFTTrainerConfig(n_workers=2 if strategy == "single" else 4, global_batch_size=12),
    )  # fmt: skip


def test_ranks_of_a_tensor_parallel_group_handed_different_rows_are_refused(model_dirs, two_ranks):
    """They would mix their rows into each other's sums: refused before any forward."""
    two_ranks.build(mesh_config(model_dirs["qwen2"], tp_size=2))
    batch = random_batch(3, batch=4, length=16)
    same = two_ranks.log_probs_of([batch, batch])
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)
    with pytest.raises(WorkerError, match="tensor-parallel group were handed different rows"):
        two_ranks.log_probs_of([batch[:2], batch[2:]])


def test_the_fsdp2_mesh_under_tensor_parallelism_is_read_as_kept_not_sliced(model_dirs, two_ranks):
    """``EngineMesh.dp_mesh``, the ``dp_sp`` ranks of a rank's tensor-parallel slice, holds the
    ranks :class:`ParallelDims` places there, and is read from the flattened mesh kept when the
    mesh was built (slicing it from the root mesh warns: torch deprecates it)."""
    two_ranks.build(mesh_config(model_dirs["qwen2"], tp_size=2, strategy="fsdp2"))
    dims = ParallelDims(2, tp=2)
    for rank, (ranks, warned) in enumerate(two_ranks.gradient_mesh()):
        assert ranks == [token * dims.tp + rank % dims.tp for token in range(dims.gradient_ranks)]
        assert not [message for message in warned if "flattened dim" in message]


@pytest.mark.gpu
def test_two_nccl_tensor_parallel_ranks_equal_one_gpu(model_dirs, gpu_groups):
    """The CPU comparison on CUDA, fp32, over NCCL (atomic adds in the embedding's backward
    reorder sums on a GPU: a looser tolerance)."""
    one, two = gpu_groups
    batch = random_batch(0, batch=6, length=24)
    config = mesh_config(model_dirs["qwen2"], device="cuda")
    one.build(config)
    whole = one.gradients(batch)[0]
    two.build(dataclasses.replace(config, tp_size=2, strategy="fsdp2"))
    assert_same_gradients(two.gradients(batch), whole, tolerance=1e-4)
