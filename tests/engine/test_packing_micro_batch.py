"""Packing equals padding; token-budget micro-batches equal one full batch; the partitioner balances."""

import functools
import itertools

import pytest
import torch

from tandem.engine import (
    EngineConfig,
    TorchTrainEngine,
    balanced_dp_order,
    karmarkar_karp,
    pack_sequences,
    token_budget_micro_batches,
    unpack,
)
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.sft.loss import sft_loss
from tests.engine.conftest import random_batch


def engine_for(family: str, **overrides) -> TorchTrainEngine:
    model = build_tiny_model(TinyModelConfig(family=family), 103, 0, 1, 4)
    engine = TorchTrainEngine(EngineConfig(**overrides), model=model)
    engine.initialize()
    return engine


def outputs_and_grads(engine: TorchTrainEngine, batch):
    outputs = engine.forward_backward(batch, None, forward_only=True).outputs
    normalizer = engine.global_normalizer(batch["loss_mask"])
    engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
    grads = {n: p.grad.clone() for n, p in engine.causal_lm.named_parameters()}
    engine.zero_grad()
    return outputs, grads


def test_pack_unpack_round_trip():
    batch = random_batch(0)
    packed = pack_sequences(batch["input_ids"], batch["attention_mask"])
    assert packed.num_tokens == int(batch["attention_mask"].sum())
    torch.testing.assert_close(unpack(packed.input_ids, packed), batch["input_ids"] * batch["attention_mask"])
    for row, (start, end) in enumerate(itertools.pairwise(packed.cu_seqlens.tolist())):
        assert packed.position_ids[0, start:end].tolist() == list(range(end - start)), row


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_log_probs_and_grads_equal_padded(family):
    batch = random_batch(1, batch=6, length=32)
    padded_out, padded_grads = outputs_and_grads(
        engine_for(family, use_packing=False, micro_batch_size=6), batch
    )
    packed_out, packed_grads = outputs_and_grads(
        engine_for(family, use_packing=True, max_tokens_per_micro_batch=4096), batch
    )
    mask = batch["attention_mask"].bool()
    assert (padded_out.log_probs[mask] != 0).float().mean() > 0.8  # real values, not zeros
    torch.testing.assert_close(packed_out.log_probs, padded_out.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(packed_out.entropy, padded_out.entropy, atol=1e-5, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize("packing,budget,micro", [(True, 40, 1), (True, 70, 1), (False, 1, 1), (False, 1, 3)])
def test_micro_batching_gives_full_batch_gradients(packing, budget, micro):
    batch = random_batch(2, batch=8, length=24)
    full_out, full_grads = outputs_and_grads(
        engine_for("qwen2", use_packing=packing, max_tokens_per_micro_batch=4096, micro_batch_size=8), batch
    )
    engine = engine_for(
        "qwen2", use_packing=packing, max_tokens_per_micro_batch=budget, micro_batch_size=micro
    )
    assert len(engine.micro_batches(batch)) > 1
    split_out, split_grads = outputs_and_grads(engine, batch)
    torch.testing.assert_close(split_out.log_probs, full_out.log_probs, atol=1e-5, rtol=0)
    for name, grad in full_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_sequence_longer_than_budget_is_named():
    with pytest.raises(
        ValueError, match="sequence 1 has 30 tokens, more than the micro-batch token budget of 20"
    ):
        token_budget_micro_batches([10, 30, 5], max_tokens=20)


@pytest.mark.parametrize("seed", range(5))
def test_karmarkar_karp_is_a_partition_close_to_the_best(seed):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randint(16, 512, (9,), generator=gen).tolist()
    parts = karmarkar_karp(weights, 3)
    assert sorted(i for part in parts for i in part) == list(range(9))
    spread = max(sum(weights[i] for i in p) for p in parts) - min(sum(weights[i] for i in p) for p in parts)
    best = min(  # brute force over all 3-way assignments
        max(sums) - min(sums)
        for labels in itertools.product(range(3), repeat=9)
        for sums in [[sum(w for w, lab in zip(weights, labels, strict=True) if lab == k) for k in range(3)]]
    )
    assert spread <= best + max(weights) // 4, (spread, best)


def test_equal_size_partition_and_budget_split():
    weights = list(range(1, 13))
    parts = karmarkar_karp(weights, 4, equal_size=True)
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert (
        max(sum(weights[i] for i in p) for p in parts) - min(sum(weights[i] for i in p) for p in parts) <= 3
    )  # optimum 1
    micro = token_budget_micro_batches(weights, max_tokens=20)
    assert (
        all(sum(weights[i] for i in p) <= 20 for p in micro) and len(micro) == 4
    )  # 78 tokens -> ceil(78 / 20)


def test_balanced_dp_order_evens_out_tokens_per_rank():
    gen = torch.Generator().manual_seed(0)
    lengths = sorted(
        torch.randint(16, 512, (32,), generator=gen).tolist()
    )  # sorted: the worst case for chunking

    def spread(order):
        sums = [sum(lengths[i] for i in order[r * 8 : (r + 1) * 8]) for r in range(4)]
        return max(sums) - min(sums)

    order = balanced_dp_order(lengths, 4)
    assert sorted(order) == list(range(32))
    assert spread(order) < 0.02 * sum(lengths) / 4 < spread(list(range(32)))
