"""Ulysses sequence parallelism: gloo processes splitting each packed row over ``sp`` ranks
compute what one process computes unsplit (outputs, loss, every gradient, a step's weights);
the collectives and the attention wrapper against the same computation on whole tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.controller import ResourcePool, WorkerError, create_worker_group
from tandem.engine import EngineConfig, LoraConfig
from tandem.engine.base import GATHER_FIELD
from tandem.engine.ulysses_attention import check_heads
from tandem.engine.varlen_attention import packed_attention
from tandem.models import TinyModelConfig, save_tiny_model
from tests.engine.conftest import random_batch
from tests.engine.mesh_comparisons import (
    TOLERANCE,
    assert_same_gradients,
    assert_within_tolerance,
    max_diff,
    mesh_groups,
)
from tests.engine.ulysses_workers import UlyssesWorker


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny models with 4 attention heads and 2 key/value heads (split over 2 ranks) or 1
    (repeated for both); and one with 3 heads, which 2 ranks cannot split."""
    root = tmp_path_factory.mktemp("ulysses")
    sizes = {
        ("qwen2", 2): TinyModelConfig(family="qwen2", num_heads=4, num_kv_heads=2),
        ("qwen2", 1): TinyModelConfig(family="qwen2", num_heads=4, num_kv_heads=1),
        ("llama", 1): TinyModelConfig(family="llama", num_heads=4, num_kv_heads=1),
        ("three heads", 1): TinyModelConfig(hidden_size=96, num_heads=3, num_kv_heads=1),
    }
    return {key: str(save_tiny_model(root / f"{key[0]}-kv{key[1]}", size)) for key, size in sizes.items()}


one_process, two_ranks, gpu_groups = mesh_groups(UlyssesWorker, "sequence-parallel")


def _gradients(group, config: EngineConfig, batch) -> list[dict]:
    group.build(config)
    return group.gradients(batch)


def _config(model_dir: str, **overrides) -> EngineConfig:
    # small token budget and no pad multiple: several micro-batches per step, rows of odd lengths
    base = EngineConfig(
        model_path=model_dir, lr=1e-2, eps=1e-3, max_tokens_per_micro_batch=48, pad_tokens_to_multiple=1
    )
    return dataclasses.replace(base, **overrides)


@pytest.mark.parametrize(
    "model,overrides,strategy",
    [
        (("qwen2", 2), {}, "ddp"),
        (("llama", 1), {}, "ddp"),  # one key/value head, repeated for both ranks
        (("qwen2", 2), {"lora": LoraConfig(rank=4, alpha=8)}, "ddp"),
        (("qwen2", 1), {"gradient_checkpointing": True}, "ddp"),
        (("qwen2", 2), {"head": "value"}, "ddp"),
        (("qwen2", 2), {"head": "reward"}, "ddp"),
        (("qwen2", 2), {}, "fsdp2"),
    ],
    ids=["actor", "actor-repeated-kv", "actor-lora", "actor-checkpointing", "critic", "reward", "fsdp2"],
)
def test_two_sequence_parallel_ranks_equal_one_process(
    model_dirs, one_process, two_ranks, model, overrides, strategy
):
    batch = random_batch(0, batch=6, length=24)
    config = _config(model_dirs[model], **overrides)
    whole = _gradients(one_process, config, batch)[0]
    split = _gradients(two_ranks, dataclasses.replace(config, sp_size=2, strategy=strategy), batch)
    assert_same_gradients(split, whole)


def test_top_k_and_named_tokens_split_over_two_ranks_equal_one_process(model_dirs, one_process, two_ranks):
    """What distillation reads (each position's top-k tokens, the log-probs of named tokens and
    their gradients) comes back whole from a split row."""
    batch = random_batch(2, batch=6, length=24)
    named = torch.randint(0, 103, (*batch["input_ids"].shape, 3), generator=torch.Generator().manual_seed(9))
    batch = batch.assign(tensors={GATHER_FIELD: named})
    config = _config(model_dirs[("qwen2", 2)])
    one_process.build(config)
    whole = one_process.token_choices(batch, 4)[0]
    two_ranks.build(dataclasses.replace(config, sp_size=2, strategy="ddp"))
    for got in two_ranks.token_choices(batch, 4):
        assert torch.equal(got["outputs"]["top_ids"], whole["outputs"]["top_ids"])
        diffs = {
            name: max_diff(got["outputs"][name], whole["outputs"][name])
            for name in ("top_log_probs", "gathered_log_probs")
        }
        diffs.update(
            {f"grad/{name}": max_diff(got["grads"][name], grad) for name, grad in whole["grads"].items()}
        )
        assert_within_tolerance(diffs)


def test_shared_prompts_split_over_two_ranks_equal_one_process(model_dirs, one_process, two_ranks):
    """Rows sharing a prompt attend to one packed copy of it; the split row keeps that."""
    batch = random_batch(1, batch=6, length=24, left_pad_rows=0)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    ids[:, :8] = ids[0, :8]  # every row starts with the same 8-token prompt
    mask[:, :10] = 1
    batch = batch.assign(tensors={"input_ids": ids * mask, "attention_mask": mask, "prompts": ids[:, :8]})
    config = _config(model_dirs[("qwen2", 2)], max_tokens_per_micro_batch=96)
    whole = _gradients(one_process, config, batch)[0]
    split = _gradients(two_ranks, dataclasses.replace(config, sp_size=2, strategy="ddp"), batch)
    assert_same_gradients(split, whole)


def test_collectives_and_attention_equal_whole_tensor_computation(two_ranks):
    """all-to-all, gather, disjoint sum and the Ulysses attention (one key/value head repeated)
    on each rank's part of whole tensors: outputs and input gradients are the whole
    computation's parts."""
    _check_collectives(two_ranks)


def _check_collectives(two_ranks, tolerance: float = TOLERANCE) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, tokens, dim = 4, 10, 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    inputs = {
        "heads": randn(1, heads, tokens, dim),
        "heads_upstream": randn(1, heads, tokens, dim),
        "tokens": randn(1, tokens, dim),
        "tokens_upstream": randn(1, tokens, dim),
        "q": randn(1, heads, tokens, dim),
        "k": randn(1, 1, tokens, dim),
        "v": randn(1, 1, tokens, dim),
        "attention_upstream": randn(1, tokens, heads, dim),
        "cu_seqlens": torch.tensor([0, 3, 7, 10], dtype=torch.int32),
    }
    leaves = {name: inputs[name].clone().requires_grad_() for name in ("q", "k", "v")}
    attended, _ = packed_attention(
        torch.nn.Module().eval(), *leaves.values(), None, cu_seq_lens_q=inputs["cu_seqlens"]
    )
    (attended * inputs["attention_upstream"]).sum().backward()
    diffs = {}
    for rank, got in enumerate(two_ranks.collectives(inputs)):
        seq, mine = slice(5 * rank, 5 * rank + 5), slice(2 * rank, 2 * rank + 2)
        expected = {
            "all_to_all": inputs["heads"][:, mine],
            "all_to_all/grad0": inputs["heads_upstream"][:, :, seq],
            "gather": inputs["tokens"],
            "gather/grad0": inputs["tokens_upstream"][:, seq],
            "sum_disjoint": inputs["tokens"],
            "sum_disjoint/grad0": inputs["tokens_upstream"],
            "attention": attended.detach()[:, seq],
            **{f"attention/grad{i}": leaves[name].grad[:, :, seq] for i, name in enumerate(("q", "k", "v"))},
        }
        assert got.keys() == expected.keys()
        diffs |= {f"rank{rank}/{name}": max_diff(got[name], tensor) for name, tensor in expected.items()}
    assert_within_tolerance(diffs, tolerance)
    assert max(v for k, v in diffs.items() if "attention" not in k) == 0.0  # pure data movement: exact


@pytest.mark.slow  # 30-55 s on a 2-core machine: four processes start
def test_dp2_sp2_mesh_step_equals_one_process(model_dirs, one_process):
    """Four ranks, two data-parallel groups of two sequence-parallel ranks: one optimizer step."""
    batch = random_batch(2, batch=8, length=24)
    config = _config(model_dirs[("qwen2", 2)])
    one_process.build(config)
    whole, whole_params = one_process.train_step(batch), one_process.parameters()[0]
    with create_worker_group(UlyssesWorker, ResourcePool((4,)), "process") as group:
        group.build(dataclasses.replace(config, sp_size=2, strategy="ddp"))
        split, split_params = group.train_step(batch), group.parameters()[0]
    diffs = {name: max_diff(split[name], whole[name]) for name in ("log_probs", "entropy", "grad_norm")}
    # the two data-parallel ranks' loss shares add up to the whole loss
    diffs["loss"] = abs(float(split["loss"][0] + split["loss"][-1]) - float(whole["loss"][0]))
    diffs |= {name: max_diff(split_params[name], tensor) for name, tensor in whole_params.items()}
    assert_within_tolerance(diffs)


@pytest.mark.parametrize(
    "model,overrides,message",
    [
        (("qwen2", 2), {"sp_size": 3}, "engine.sp_size=3 must divide the world size 2"),
        (
            ("three heads", 1),
            {"sp_size": 2},
            "engine.sp_size=2 must divide the model's num_attention_heads=3",
        ),
    ],
    ids=["world-size", "heads"],
)
def test_a_mesh_that_does_not_fit_is_refused(model_dirs, two_ranks, model, overrides, message):
    config = _config(model_dirs[model], **{"strategy": "ddp", **overrides})
    with pytest.raises(WorkerError, match=message):
        two_ranks.build(config)


def test_ranks_of_a_group_handed_different_rows_are_refused(model_dirs, two_ranks):
    two_ranks.build(_config(model_dirs[("qwen2", 2)], sp_size=2, strategy="ddp"))
    batch = random_batch(3, batch=4, length=16)
    same = two_ranks.log_probs_of([batch, batch])
    torch.testing.assert_close(same[0], same[1], rtol=0, atol=0)
    with pytest.raises(WorkerError, match="sequence-parallel group were handed different rows"):
        two_ranks.log_probs_of([batch[:2], batch[2:]])


def test_single_strategy_splits_rows_for_forward_passes_only(model_dirs, one_process, two_ranks):
    """A frozen reference model needs no gradient reduction: ``single`` runs forward passes
    split over the group, and refuses to train (its gradients would stay partial)."""
    config = _config(model_dirs[("qwen2", 2)])
    batch = random_batch(4, batch=4, length=16)
    one_process.build(config)
    (whole,) = one_process.log_probs_of([batch])
    two_ranks.build(dataclasses.replace(config, sp_size=2, strategy="single"))
    split = two_ranks.log_probs_of([batch, batch])
    assert_within_tolerance({f"rank{rank}": max_diff(values, whole) for rank, values in enumerate(split)})
    with pytest.raises(WorkerError, match="engine.sp_size=2 trains with engine.strategy ddp or fsdp2 only"):
        two_ranks.gradients(batch)


def test_heads_that_do_not_split_are_refused():
    check_heads(8, 2, 4)  # query heads split, key/value heads repeated twice
    check_heads(8, 4, 2)  # both split
    with pytest.raises(ValueError, match=r"engine.sp_size=4 must divide the model's num_attention_heads=6"):
        check_heads(6, 2, 4)
    with pytest.raises(ValueError, match=r"engine.sp_size=4 and the model's num_key_value_heads=3"):
        check_heads(12, 3, 4)


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"sp_size": 2, "use_packing": False}, "engine.sp_size=2 needs engine.use_packing=True"),
        ({"sp_size": 0}, "sp_size"),
    ],
)
def test_config_refuses_what_is_not_built(overrides, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model,overrides,strategy",
    [
        (("qwen2", 2), {}, "ddp"),
        (("qwen2", 1), {"lora": LoraConfig(rank=4, alpha=8), "gradient_checkpointing": True}, "fsdp2"),
        (("qwen2", 2), {"head": "value"}, "ddp"),
    ],
    ids=["actor", "actor-repeated-kv-lora-checkpointing-fsdp2", "critic"],
)
def test_two_nccl_sequence_parallel_ranks_equal_one_gpu(model_dirs, gpu_groups, model, overrides, strategy):
    """The CPU comparison on CUDA, fp32, over NCCL (atomic adds in the embedding's backward
    reorder sums on a GPU: a looser tolerance)."""
    one, two = gpu_groups
    batch = random_batch(0, batch=6, length=24)
    config = _config(model_dirs[model], device="cuda", **overrides)
    whole = _gradients(one, config, batch)[0]
    split = _gradients(two, dataclasses.replace(config, sp_size=2, strategy=strategy), batch)
    assert_same_gradients(split, whole, tolerance=1e-4)


@pytest.mark.gpu
def test_nccl_collectives_equal_whole_tensor_computation(gpu_groups):
    """The collectives over NCCL; the attention runs on the GPU, its reference on the CPU."""
    _check_collectives(gpu_groups[1], tolerance=1e-4)
