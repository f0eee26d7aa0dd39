"""Expert parallelism: two gloo processes, each holding half of every MoE layer's experts and
its own rows, compute what one process computes with every expert on all the rows (outputs,
loss, every gradient, a step's weights), with routing replay and the load-balancing loss;
checkpoints move between ``ep`` sizes; exports and weight syncs see whole expert tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.controller import ResourcePool, WorkerError, create_worker_group
from tandem.engine import LoraConfig
from tandem.engine.expert_parallel import check_experts_fit
from tandem.models import TinyModelConfig, build_tiny_model, save_tiny_model
from tandem.protocol import Batch
from tests.engine.bf16_cpu import needs_bf16_cpu
from tests.engine.conftest import random_batch
from tests.engine.expert_parallel_workers import ExpertParallelWorker
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

LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny Qwen2-MoE (shared expert) and Qwen3-MoE models with 4 experts, 2 per token, and a dense Qwen2."""
    root = tmp_path_factory.mktemp("expert_parallel")
    sizes = {
        "qwen2_moe": TinyModelConfig(family="qwen2_moe", num_heads=4, num_kv_heads=2),
        "qwen3_moe": TinyModelConfig(family="qwen3_moe", num_heads=4, num_kv_heads=2),
        "qwen2": TinyModelConfig(family="qwen2", num_heads=4, num_kv_heads=2),
    }
    return {key: str(save_tiny_model(root / key, size)) for key, size in sizes.items()}


one_process, two_ranks, gpu_groups = mesh_groups(ExpertParallelWorker, "expert-parallel")


def _routed_batch(seed: int, rows: int = 8, length: int = 24) -> Batch:
    """:func:`random_batch` with a random recorded routing (mostly not the live choice; ``-1`` on
    padding and on a few tokens, which then route live)."""
    batch = random_batch(seed, batch=rows, length=length)
    gen = torch.Generator().manual_seed(seed)
    routed = torch.stack(
        [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(rows * length * LAYERS)]
    )
    routed = routed.view(rows, length, LAYERS, TOP_K).to(torch.int16)
    routed[~batch["attention_mask"].bool()] = -1
    routed[:, 3] = -1
    return batch.assign({"routed_experts": routed})


def _halves(batch: Batch) -> list[Batch]:
    half = len(batch) // 2
    return [batch[:half], batch[half:]]


def _assert_same_gradients(split: list[dict], whole: dict) -> None:
    """The ranks' outputs (their rows, in order) and losses (shares of the whole) put together,
    and each rank's full gradients, equal the one-process ones."""
    diffs = {}
    for name, values in whole["outputs"].items():
        joined = torch.cat([got["outputs"][name] for got in split])
        diffs[name] = max_diff(joined, values)
    diffs["loss"] = abs(sum(got["loss"] for got in split) - whole["loss"])
    for rank, got in enumerate(split):
        assert got["grads"].keys() == whole["grads"].keys()
        diffs |= {f"rank{rank}/grad/{n}": max_diff(got["grads"][n], g) for n, g in whole["grads"].items()}
    assert_within_tolerance(diffs)


@pytest.mark.parametrize(
    "model,overrides,strategy",
    [
        ("qwen2_moe", {}, "ddp"),
        ("qwen3_moe", {}, "fsdp2"),
        ("qwen2_moe", {"router_replay": "rollout"}, "ddp"),
        ("qwen3_moe", {"gradient_checkpointing": True, "router_replay": "rollout"}, "fsdp2"),
        ("qwen2_moe", {"use_packing": False, "micro_batch_size": 3}, "ddp"),
    ],
    ids=["qwen2-ddp", "qwen3-fsdp2", "replay", "checkpointing-replay-fsdp2", "padded"],
)
def test_two_expert_parallel_ranks_equal_one_process(
    model_dirs, one_process, two_ranks, model, overrides, strategy
):
    batch = _routed_batch(0)
    config = mesh_config(model_dirs[model], **overrides)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    two_ranks.build(dataclasses.replace(config, ep_size=2, strategy=strategy))
    assert all(set(held.values()) == {EXPERTS // 2} for held in two_ranks.local_experts())
    _assert_same_gradients(two_ranks.shard_gradients(_halves(batch)), whole)


def test_a_rank_with_fewer_micro_batches_joins_the_exchanges(model_dirs, one_process, two_ranks):
    """Rank 0 gets 2 rows (one micro-batch), rank 1 gets 6 (three): rank 0 runs two zero-weighted
    passes, whose MoE layers still exchange tokens with rank 1's, forward and backward."""
    batch = _routed_batch(7)
    config = mesh_config(
        model_dirs["qwen2_moe"], use_packing=False, micro_batch_size=2, router_replay="rollout"
    )
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    two_ranks.build(dataclasses.replace(config, ep_size=2, strategy="ddp"))
    _assert_same_gradients(two_ranks.shard_gradients([batch[:2], batch[2:]]), whole)


def test_load_balancing_loss_under_expert_parallelism_equals_data_parallelism(model_dirs, two_ranks):
    """The load-balancing loss is each micro-batch's (a product of two means over its tokens, so
    it depends on how rows are split): ``ep=2`` equals the same two ranks holding every expert."""
    batch = _routed_batch(1)
    config = mesh_config(
        model_dirs["qwen2_moe"], strategy="ddp", moe_aux_loss_coef=0.1, router_replay="rollout"
    )
    two_ranks.build(config)
    replicated = two_ranks.shard_gradients(_halves(batch))
    two_ranks.build(dataclasses.replace(config, ep_size=2))
    split = two_ranks.shard_gradients(_halves(batch))
    diffs = {}
    for rank, (got, expected) in enumerate(zip(split, replicated, strict=True)):
        diffs[f"rank{rank}/loss"] = abs(got["loss"] - expected["loss"])
        diffs |= {f"rank{rank}/{n}": max_diff(got["outputs"][n], v) for n, v in expected["outputs"].items()}
        diffs |= {f"rank{rank}/grad/{n}": max_diff(got["grads"][n], g) for n, g in expected["grads"].items()}
    assert_within_tolerance(diffs)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_expert_parallel_optimizer_step_equals_one_process(model_dirs, one_process, two_ranks, strategy):
    """The clipped grad norm (reduced over the expert shards), the loss and every updated weight,
    with routing replay."""
    batch = _routed_batch(2)
    config = mesh_config(model_dirs["qwen2_moe"], grad_clip=0.5, router_replay="rollout")
    one_process.build(config)
    whole = train_step(one_process, batch)
    two_ranks.build(dataclasses.replace(config, ep_size=2, strategy=strategy))
    assert_same_step(train_step(two_ranks, batch), whole, dp_size=2)


@pytest.mark.parametrize("saved_ep,resumed_ep", [(2, 1), (1, 2)])
def test_checkpoint_resumes_under_another_expert_parallel_size(
    model_dirs, one_process, two_ranks, tmp_path, saved_ep, resumed_ep
):
    """A checkpoint saved under one ``ep_size`` and resumed under another trains on exactly as it
    does resumed under the ``ep_size`` that saved it (the expert shards and their Adam moments
    are DTensors of the whole shapes: DCP reads each rank's part)."""
    groups = {1: one_process, 2: two_ranks}
    config = mesh_config(model_dirs["qwen3_moe"], router_replay="rollout")
    configs = {1: config, 2: dataclasses.replace(config, ep_size=2, strategy="fsdp2")}
    first, second = _routed_batch(3), _routed_batch(4)
    resumed = resumed_steps(groups, configs, saved_ep, resumed_ep, first, second, tmp_path)
    assert_same_step(resumed[2], resumed[1], dp_size=2)


def test_export_and_weight_sync_give_whole_expert_tensors(model_dirs, one_process, two_ranks, tmp_path):
    """After one step, the HF export and the weight-sync buckets of an ep=2 engine hold the
    one-process engine's whole tensors (every expert), gathered one tensor at a time."""
    batch = _routed_batch(5)
    config = mesh_config(model_dirs["qwen2_moe"])
    one_process.build(config)
    split = dataclasses.replace(config, ep_size=2, strategy="ddp")
    diffs, exported = export_and_sync_diffs(one_process, two_ranks, split, batch, tmp_path)
    assert exported["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == EXPERTS
    assert_within_tolerance(diffs)


@pytest.mark.slow  # four processes start on a 2-core machine
@pytest.mark.parametrize("ep_size,sp_size", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_four_ranks_expert_parallel_step_equals_one_process(model_dirs, one_process, ep_size, sp_size):
    """Four ranks: two expert-parallel groups of two (each expert shard's gradient summed over the
    two ranks holding it), or one group of four (one expert per rank); as four data-parallel
    ranks, or as two data-parallel groups of two sequence-parallel ranks (``ep=2``: the groups
    exchanging tokens are the sequence-parallel ones; ``ep=4``: they span both)."""
    batch = _routed_batch(2)
    config = mesh_config(model_dirs["qwen2_moe"], router_replay="rollout")
    one_process.build(config)
    whole = train_step(one_process, batch)
    with create_worker_group(ExpertParallelWorker, ResourcePool((4,)), "process") as group:
        group.build(dataclasses.replace(config, ep_size=ep_size, sp_size=sp_size, strategy="ddp"))
        assert all(set(held.values()) == {EXPERTS // ep_size} for held in group.local_experts())
        split = train_step(group, batch)
    assert_same_step(split, whole, dp_size=4 // sp_size)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lora_with_expert_parallelism_equals_one_process(
    model_dirs, one_process, two_ranks, strategy, tmp_path
):
    """LoRA adapts the linear layers (attention, Qwen2-MoE's shared expert): the split experts
    are frozen base weights. The adapters' gradients and, after one step, the merged weights a
    weight sync sends (every expert gathered whole) equal one process's."""
    batch = _routed_batch(12)
    config = mesh_config(model_dirs["qwen2_moe"], router_replay="rollout", lora=LoraConfig(rank=4))
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    assert any("shared_expert" in name for name in whole["grads"])
    assert not any("experts." in name for name in whole["grads"])  # the routed experts stay frozen
    one_process.train_step(batch)
    merged = one_process.weight_buckets(1 << 20)[0]["tensors"]
    two_ranks.build(dataclasses.replace(config, ep_size=2, strategy=strategy))
    assert all(set(held.values()) == {EXPERTS // 2} for held in two_ranks.local_experts())
    _assert_same_gradients(two_ranks.shard_gradients(_halves(batch)), whole)
    two_ranks.train_step(batch)
    diffs = {}
    for rank, got in enumerate(two_ranks.weight_buckets(1 << 20)):
        assert got["tensors"].keys() == merged.keys()
        diffs |= {f"rank{rank}/{name}": max_diff(got["tensors"][name], t) for name, t in merged.items()}
    assert_within_tolerance(diffs)


@pytest.mark.parametrize(
    "family,experts,message",
    [
        ("qwen2_moe", 3, "engine.ep_size=2 must divide the model's num_experts=3: each expert-parallel rank"),
        ("qwen2", 4, "engine.ep_size=2: Qwen2ForCausalLM has no mixture-of-experts layers to split"),
    ],
    ids=["experts", "dense"],
)
def test_models_whose_experts_do_not_split_are_refused(family, experts, message):
    model = build_tiny_model(TinyModelConfig(family=family, num_experts=experts), 103, 0, 1, 2)
    with pytest.raises(ValueError, match=message):
        check_experts_fit(model, 2)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"ep_size": 4, "strategy": "ddp"}, "engine.ep_size=4 must divide the world size 2"),
        (
            {"ep_size": 2, "tp_size": 2, "strategy": "fsdp2"},
            "engine.ep_size=2 must divide the 1 data-parallel ranks \\(the world size 2 over engine.tp_size=2\\)",
        ),
    ],
    ids=["world", "tensor-parallel"],
)
def test_a_world_that_does_not_divide_into_expert_parallel_groups_is_refused(
    model_dirs, two_ranks, overrides, message
):
    with pytest.raises(WorkerError, match=message):
        two_ranks.build(mesh_config(model_dirs["qwen2_moe"], **overrides))


def test_single_strategy_runs_forward_passes_only(model_dirs, one_process, two_ranks):
    """A frozen reference (``single``) splits its experts and scores each rank's own rows like one
    process does; training it is refused (its replicated weights' gradients would not be reduced)."""
    batch = _routed_batch(6)
    config = mesh_config(model_dirs["qwen2_moe"], router_replay="rollout")
    one_process.build(config)
    whole = one_process.log_probs_of([batch])[0]
    two_ranks.build(dataclasses.replace(config, ep_size=2))
    split = torch.cat(two_ranks.log_probs_of(_halves(batch)))
    assert_within_tolerance({"log_probs": max_diff(split, whole)})
    with pytest.raises(
        WorkerError, match="engine.ep_size=2 with engine.strategy=single: the expert-parallel"
    ):
        two_ranks.shard_gradients(_halves(batch))


@pytest.mark.parametrize(
    "model,overrides,strategy,ep_size",
    [
        ("qwen2_moe", {"router_replay": "rollout", "moe_aux_loss_coef": 0.1}, "ddp", 2),
        ("qwen3_moe", {"gradient_checkpointing": True, "router_replay": "rollout"}, "fsdp2", 2),
        ("qwen2_moe", {"router_replay": "rollout", "moe_aux_loss_coef": 0.1}, "fsdp2", 1),
    ],
    ids=["qwen2-replay-aux-ddp", "qwen3-checkpointing-replay-fsdp2", "sp-only-replay-aux-fsdp2"],
)
def test_expert_and_sequence_parallel_ranks_equal_one_process(
    model_dirs, one_process, two_ranks, model, overrides, strategy, ep_size
):
    """``sp=2`` on two ranks: each packed row (and its recorded routing) is split over the two
    ranks; with ``ep=2`` each MoE layer sends a rank's sequence shard's tokens to the experts'
    owners and back, with ``ep=1`` each rank holds every expert. The load-balancing loss is the
    whole micro-batch's (its router logits gathered over the two ranks), as in one process."""
    batch = _routed_batch(8)
    config = mesh_config(model_dirs[model], **overrides)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    two_ranks.build(dataclasses.replace(config, ep_size=ep_size, sp_size=2, strategy=strategy))
    if ep_size > 1:
        assert all(set(held.values()) == {EXPERTS // ep_size} for held in two_ranks.local_experts())
    assert_same_gradients(two_ranks.gradients(batch), whole)


@pytest.mark.parametrize(
    "model,overrides,strategy",
    [
        ("qwen2_moe", {"router_replay": "rollout"}, "single"),
        ("qwen3_moe", {"router_replay": "rollout", "gradient_checkpointing": True}, "fsdp2"),
    ],
    ids=["qwen2-replay-single", "qwen3-checkpointing-replay-fsdp2"],
)
def test_tensor_parallel_moe_equals_one_process(
    model_dirs, one_process, two_ranks, model, overrides, strategy
):
    """``tp=2`` on an MoE model: attention (and the vocabulary) split over the two ranks, each MoE
    block whole on both, which hold the same rows."""
    batch = _routed_batch(9)
    config = mesh_config(model_dirs[model], **overrides)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    two_ranks.build(dataclasses.replace(config, tp_size=2, strategy=strategy))
    assert_same_gradients(two_ranks.gradients(batch), whole)


def test_expert_and_tensor_parallel_step_equals_one_process(model_dirs, one_process):
    """Four ranks, ``(dp, tp) = (2, 2)`` with ``ep=2``: the two data-parallel ranks of each
    tensor-parallel rank exchange tokens and split the experts; one optimizer step (clipped)."""
    batch = _routed_batch(10)
    config = mesh_config(model_dirs["qwen3_moe"], router_replay="rollout", grad_clip=0.5)
    one_process.build(config)
    whole = train_step(one_process, batch)
    with create_worker_group(ExpertParallelWorker, ResourcePool((4,)), "process") as group:
        group.build(dataclasses.replace(config, ep_size=2, tp_size=2, strategy="fsdp2"))
        assert all(set(held.values()) == {EXPERTS // 2} for held in group.local_experts())
        split = train_step(group, batch)
    assert_same_step(split, whole, dp_size=2)


@needs_bf16_cpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_bf16_expert_parallel_ranks_agree_with_replicated_experts(model_dirs, two_ranks, strategy):
    """``mixed_precision=bf16`` (DDP: autocast; FSDP2: its policy, which skips the ignored expert
    shards, cast to bf16 in the layer): ``ep=2`` against the same two ranks holding every expert,
    within bf16's rounding; the expert shards' gradients stay fp32 (the master weights' dtype).
    Qwen3-MoE, whose per-head norms hand fp32 queries to the attention beside bf16 values."""
    batch = _routed_batch(11)
    config = mesh_config(
        model_dirs["qwen3_moe"], router_replay="rollout", mixed_precision="bf16", strategy=strategy
    )
    two_ranks.build(config)
    replicated = two_ranks.shard_gradients(_halves(batch))
    two_ranks.build(dataclasses.replace(config, ep_size=2))
    split = two_ranks.shard_gradients(_halves(batch))
    for got, expected in zip(split, replicated, strict=True):
        assert got["loss"] == pytest.approx(expected["loss"], rel=1e-3)
        for name, values in expected["outputs"].items():
            assert max_diff(got["outputs"][name], values) <= 1e-2, name
        for name, grad in expected["grads"].items():
            assert got["grads"][name].dtype == torch.float32, name
            assert max_diff(got["grads"][name], grad) <= 3e-2 * float(grad.abs().max()), name
