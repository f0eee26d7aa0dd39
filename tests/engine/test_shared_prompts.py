"""Shared-prompt packing against plain packing: same response log-probs, entropy and gradients."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine, pack_sequences, token_budget_micro_batches, unpack
from tandem.engine.packing import pad_to_multiple
from tandem.engine.shared_prompts import pack_shared_prompts, prompt_groups
from tandem.engine.varlen_attention import bucket_length, contiguous_plan, plan_sequences
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.protocol import Batch

PROMPT_WIDTH, RESPONSE_WIDTH = 9, 12


def grouped_batch(seed: int, groups: int = 4, n: int = 3, vocab: int = 103) -> Batch:
    """``groups`` prompts (left-padded, 1..9 tokens) with ``n`` responses each (right-padded,
    0..12 tokens; one empty), rows of a group interleaved with other groups' rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = groups * n
    prompt_lengths = torch.randint(1, PROMPT_WIDTH + 1, (groups,), generator=gen)
    prompt_ids = torch.randint(6, vocab, (groups, PROMPT_WIDTH), generator=gen)
    prompt_mask = (torch.arange(PROMPT_WIDTH).flip(0) < prompt_lengths[:, None]).long()
    response_lengths = torch.randint(0, RESPONSE_WIDTH + 1, (rows,), generator=gen)
    response_lengths[1] = 0
    response_mask = (torch.arange(RESPONSE_WIDTH) < response_lengths[:, None]).long()
    responses = torch.randint(6, vocab, (rows, RESPONSE_WIDTH), generator=gen) * response_mask
    group_of_row = torch.arange(rows) % groups  # interleaved: rows of one group are not adjacent
    prompts = prompt_ids[group_of_row] * prompt_mask[group_of_row]
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([prompt_mask[group_of_row], response_mask], 1),
            "response_mask": response_mask,
            "weights": torch.randn(rows, RESPONSE_WIDTH, generator=gen),
        }
    )


def weighted_loss(micro: Batch, outputs):
    """A loss that reaches every response log-prob and entropy with its own weight."""
    mask = micro["response_mask"]
    log_probs = outputs.log_probs[:, PROMPT_WIDTH:]
    entropy = outputs.entropy[:, PROMPT_WIDTH:]
    loss = ((log_probs * micro["weights"] + 0.1 * entropy) * mask).sum() / 100
    return loss, {}


def engine_for(family: str, **overrides) -> TorchTrainEngine:
    model = build_tiny_model(TinyModelConfig(family=family), 103, 0, 1, 4)
    engine = TorchTrainEngine(EngineConfig(**overrides), model=model)
    engine.initialize()
    return engine


def outputs_and_grads(engine: TorchTrainEngine, batch: Batch):
    outputs = engine.forward_backward(batch, None, forward_only=True).outputs
    engine.forward_backward(batch, weighted_loss)
    grads = {n: p.grad.clone() for n, p in engine.causal_lm.named_parameters()}
    engine.zero_grad()
    return outputs, grads


def test_groups_are_rows_with_equal_valid_prompt_tokens():
    batch = grouped_batch(0, groups=3, n=2)
    assert prompt_groups(batch["input_ids"], batch["attention_mask"], PROMPT_WIDTH) == [
        [0, 3],
        [1, 4],
        [2, 5],
    ]


def test_packed_row_holds_each_prompt_once_and_every_response_token():
    batch = grouped_batch(1)
    packed = pack_shared_prompts(batch["input_ids"], batch["attention_mask"], PROMPT_WIDTH)
    prompt_tokens = sum(int(batch["attention_mask"][rows[0], :PROMPT_WIDTH].sum())
                        for rows in prompt_groups(batch["input_ids"], batch["attention_mask"], PROMPT_WIDTH))  # fmt: skip
    assert packed.num_tokens == prompt_tokens + int(batch["response_mask"].sum())
    # Unpacking the packed ids gives back exactly the response tokens.
    restored = unpack(packed.input_ids, packed)
    torch.testing.assert_close(restored[:, PROMPT_WIDTH:], batch["responses"])
    assert not restored[:, :PROMPT_WIDTH].any()
    # Each response continues its prompt's positions.
    positions = unpack(packed.position_ids, packed)[:, PROMPT_WIDTH:]
    prompt_lengths = batch["attention_mask"][:, :PROMPT_WIDTH].sum(-1, keepdim=True)
    expected = (prompt_lengths + torch.arange(RESPONSE_WIDTH)) * batch["response_mask"]
    torch.testing.assert_close(positions, expected)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_shared_prompts_equal_plain_packing(family):
    batch = grouped_batch(2)
    plain_out, plain_grads = outputs_and_grads(engine_for(family, share_prompts=False), batch)
    shared_out, shared_grads = outputs_and_grads(engine_for(family, share_prompts=True), batch)
    mask = batch["response_mask"].bool()
    plain_lp, shared_lp = plain_out.log_probs[:, PROMPT_WIDTH:], shared_out.log_probs[:, PROMPT_WIDTH:]
    assert (plain_lp[mask] != 0).all()  # real values, not zeros
    torch.testing.assert_close(shared_lp[mask], plain_lp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        shared_out.entropy[:, PROMPT_WIDTH:][mask],
        plain_out.entropy[:, PROMPT_WIDTH:][mask],
        atol=1e-5,
        rtol=0,
    )
    assert not shared_out.log_probs[:, :PROMPT_WIDTH].any()  # prompts get no log-probs
    for name, grad in plain_grads.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("budget", [40, 75])
def test_micro_batches_keep_groups_together_and_match_one_batch(budget):
    batch = grouped_batch(3, groups=4, n=3)
    full_out, full_grads = outputs_and_grads(engine_for("qwen2", max_tokens_per_micro_batch=4096), batch)
    engine = engine_for("qwen2", max_tokens_per_micro_batch=budget)
    parts = engine.micro_batches(batch)
    assert len(parts) > 1
    groups = prompt_groups(batch["input_ids"], batch["attention_mask"], PROMPT_WIDTH)
    lengths = batch["attention_mask"].sum(-1)
    for rows in groups:  # a group fits the budget -> all its rows in one micro-batch
        cost = int(lengths[rows].sum()) - (len(rows) - 1) * int(
            batch["attention_mask"][rows[0], :PROMPT_WIDTH].sum()
        )
        holders = {i for i, part in enumerate(parts) for row in rows if row in part}
        assert cost > budget or len(holders) == 1
    split_out, split_grads = outputs_and_grads(engine, batch)
    torch.testing.assert_close(split_out.log_probs, full_out.log_probs, atol=1e-5, rtol=0)
    for name, grad in full_grads.items():
        torch.testing.assert_close(split_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_group_over_budget_is_split_into_rows():
    lengths = [10, 12, 11]
    whole = token_budget_micro_batches(lengths, 30, groups=[([0, 1, 2], 8)])  # 8 + 2 + 4 + 3 = 17
    assert whole == [[0, 1, 2]]
    split = token_budget_micro_batches(lengths, 12, groups=[([0, 1, 2], 2)])  # 2 + 8 + 10 + 9 = 29
    assert sorted(row for part in split for row in part) == [0, 1, 2] and len(split) == 3
    with pytest.raises(ValueError, match="each of the 3 rows exactly once"):
        token_budget_micro_batches(lengths, 30, groups=[([0, 1], 8)])


def test_plans_check_ownership():
    plan = contiguous_plan(torch.tensor([0, 3, 5, 25], dtype=torch.int32))
    assert plan.buckets == ((2, 16, 16), (1, 32, 32))  # lengths 3, 2 -> 16; 20 -> 32
    assert plan.offsets == (None, None)  # every query at its own key position
    assert plan.query_index[plan.select].tolist() == list(range(25))
    with pytest.raises(ValueError, match="own each of the 4 packed positions exactly once"):
        plan_sequences(
            [torch.arange(3), torch.tensor([0, 3])],
            [torch.ones(3, dtype=torch.bool), torch.ones(2, dtype=torch.bool)],
            4,
        )
    with pytest.raises(ValueError, match="ownership mask of its own length"):
        plan_sequences([torch.arange(3)], [torch.ones(2, dtype=torch.bool)], 3)
    with pytest.raises(ValueError, match="sequence 1 must own a suffix"):
        plan_sequences(
            [torch.arange(3), torch.tensor([0, 3, 4])],
            [torch.ones(3, dtype=torch.bool), torch.tensor([False, True, False])],
            5,
        )


def test_responses_compute_no_prompt_queries():
    """Only the group's first row has query rows at the prompt; the others read its keys."""
    batch = grouped_batch(6, groups=2, n=4)
    packed = pack_shared_prompts(batch["input_ids"], batch["attention_mask"], PROMPT_WIDTH)
    plan = packed.attention_plan
    lengths = batch["attention_mask"].sum(-1)
    responses = batch["response_mask"].sum(-1)
    owners = [0, 1]  # rows 0 and 1 open the two interleaved groups
    attending = [r for r in range(len(lengths)) if r in owners or responses[r]]  # rows with queries
    keys = sum(bucket_length(int(lengths[r])) for r in attending)  # each reads its prompt's keys
    queries = sum(bucket_length(int(lengths[r] if r in owners else responses[r])) for r in attending)
    assert plan.index.numel() == keys and plan.query_index.numel() == queries < keys
    assert any(offsets is not None for offsets in plan.offsets)


def test_bucket_lengths_pad_at_most_an_eighth_beyond_16():
    for length in range(1, 5000):
        padded = bucket_length(length)
        assert length <= padded <= max(16 * -(-length // 16), int(length * 1.125) + 1), length
    assert [bucket_length(n) for n in (1, 16, 17, 200, 1000)] == [16, 16, 32, 208, 1024]


def test_empty_prompt_is_named():
    batch = grouped_batch(4)
    mask = batch["attention_mask"].clone()
    mask[2, :PROMPT_WIDTH] = 0
    with pytest.raises(ValueError, match="row 2 has an empty prompt"):
        pack_shared_prompts(batch["input_ids"], mask, PROMPT_WIDTH)


@pytest.mark.parametrize("share", [False, True])
def test_filler_tokens_change_nothing(share):
    batch = grouped_batch(5)
    exact_out, exact_grads = outputs_and_grads(
        engine_for("qwen2", share_prompts=share, pad_tokens_to_multiple=1), batch
    )
    engine = engine_for("qwen2", share_prompts=share, pad_tokens_to_multiple=48)
    packed = (pack_shared_prompts(batch["input_ids"], batch["attention_mask"], PROMPT_WIDTH) if share
              else pack_sequences(batch["input_ids"], batch["attention_mask"]))  # fmt: skip
    assert pad_to_multiple(packed, 48).num_tokens % 48 == 0 and packed.num_tokens % 48 != 0
    padded_out, padded_grads = outputs_and_grads(engine, batch)
    torch.testing.assert_close(padded_out.log_probs, exact_out.log_probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(padded_out.entropy, exact_out.entropy, atol=1e-5, rtol=0)
    for name, grad in exact_grads.items():
        torch.testing.assert_close(padded_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
