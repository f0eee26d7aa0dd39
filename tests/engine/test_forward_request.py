"""The forward request of a micro-batch against what the engine handed the model and the routers
before there was one (the per-field code paths, transcribed below): packed with routing, gather
ids and fillers, cut for two sequence-parallel ranks; and padded. Checked bit for bit (dtype,
shape, values) against a capture of the old engine when the request was introduced."""

from __future__ import annotations

import dataclasses
import math

import torch

from tandem.engine.base import GATHER_FIELD
from tandem.engine.forward_request import check_head_request
from tandem.engine.packing import next_token_predictions, pack_per_token, pack_sequences, pad_to_multiple
from tandem.engine.ulysses import SequenceParallel
from tests.models.test_moe import padded_batch, tiny

PAD_MULTIPLE, SP = 5, 2


def _engine(use_packing: bool, sp_rank: int = 0):
    from tandem.engine import EngineConfig, TorchTrainEngine

    config = EngineConfig(
        lr=1e-3, router_replay="rollout", pad_tokens_to_multiple=PAD_MULTIPLE, use_packing=use_packing
    )
    engine = TorchTrainEngine(config, model=tiny("qwen2_moe"))
    engine.initialize()
    if use_packing:  # two sequence-parallel ranks' layout, without the collectives
        object.__setattr__(engine, "config", dataclasses.replace(engine.config, sp_size=SP))
        engine.sequence_parallel = SequenceParallel(None, SP, sp_rank)
    return engine


def _batch():
    batch = padded_batch()
    named = torch.randint(0, 103, (*batch["input_ids"].shape, 2), generator=torch.Generator().manual_seed(3))
    return batch.assign({GATHER_FIELD: named})


def _captured(engine, batch) -> dict:
    seen = {}

    def model(request):
        seen["request"] = request
        return {"log_probs": torch.zeros(request.input_ids.shape)}

    engine.wrapped = model
    with engine.routing.micro_batch() as moe:
        moe.start = lambda recorded, real: seen.update(start=(recorded, real))
        engine._forward(batch, False, moe, 3)
    return seen


def _old_packed(batch, sp_rank: int) -> dict:
    """What ``_run_packed`` computed field by field before the request (transcribed)."""
    packed = pack_sequences(batch["input_ids"], batch["attention_mask"])
    packed = pad_to_multiple(packed, math.lcm(PAD_MULTIPLE, SP))
    packed = dataclasses.replace(packed, predictions=next_token_predictions(packed.position_ids))
    real = pack_per_token(torch.ones(packed.padded_shape, dtype=torch.bool), packed, fill=False)
    recorded = pack_per_token(batch["routed_experts"], packed, fill=-1)
    sp = SequenceParallel(None, SP, sp_rank)
    real, recorded = sp.shard(real), sp.shard(recorded)
    return {
        "start": (recorded[0], real[0]),
        "input_ids": packed.input_ids,
        "position_ids": packed.position_ids,
        "plan_index": packed.attention_plan.index,
        "sources": packed.predictions.sources,
        "targets": packed.predictions.targets,
        "gather_ids": pack_per_token(batch[GATHER_FIELD], packed),
    }


def _assert_identical(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert torch.equal(got, want), name


def test_packed_request_with_routing_gather_ids_and_fillers_over_two_ranks_equals_the_old_kwargs():
    batch = _batch()
    for rank in range(SP):
        seen = _captured(_engine(True, rank), batch)
        request, old = seen["request"], _old_packed(batch, rank)
        assert (
            request.sequence_parallel.rank == rank and request.top_k == 3 and request.attention_mask is None
        )
        fields = {
            "input_ids": request.input_ids,
            "position_ids": request.position_ids,
            "plan_index": request.attention_plan.index,
            "sources": request.predictions.sources,
            "targets": request.predictions.targets,
            "gather_ids": request.gather_ids,
        }
        for name, values in fields.items():
            _assert_identical(values, old[name], f"rank {rank}: {name}")
        for got, want, name in zip(seen["start"], old["start"], ("recorded", "real"), strict=True):
            _assert_identical(got, want, f"rank {rank}: {name}")


def test_padded_request_equals_the_old_window():
    batch = _batch()
    seen = _captured(_engine(False), batch)
    request, mask = seen["request"], batch["attention_mask"]
    used = mask.any(0).nonzero().flatten()
    window = slice(int(used[0]), int(used[-1]) + 1)
    _assert_identical(request.input_ids, batch["input_ids"][:, window], "input_ids")
    _assert_identical(request.attention_mask, mask[:, window], "attention_mask")
    _assert_identical(request.gather_ids, batch[GATHER_FIELD][:, window], "gather_ids")
    _assert_identical(seen["start"][0], batch["routed_experts"][:, window].flatten(0, 1), "recorded")
    _assert_identical(seen["start"][1], mask[:, window].reshape(-1).bool(), "real")


def test_a_value_head_refuses_a_policys_outputs_naming_the_key():
    check_head_request("lm", True, 3, True)
    for asked in ({"with_sum_pi_squared": True}, {"top_k": 2}, {"gathers": True}):
        settings = {"with_sum_pi_squared": False, "top_k": 0, "gathers": False, **asked}
        try:
            check_head_request("value", **settings)
        except ValueError as error:
            assert "engine.head='value'" in str(error)
        else:
            raise AssertionError(f"{asked} was not refused")
