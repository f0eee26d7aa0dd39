"""Mixture-of-experts models in the rollout engines: HF's decoder path, log-probs equal to the
trainer's, recorded routing equal across engines and replayed by the trainer."""

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model
from tandem.protocol import Batch
from tandem.protocol.sequences import response_part, sequence_tensors
from tandem.rollout import (
    HFRolloutEngine,
    NativeEngineConfig,
    NativeRolloutEngine,
    RolloutRequest,
    SamplingParams,
)
from tests.rollout.test_native_engine import random_prompts


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe"])
def moe_dir(request, tmp_path_factory):
    config = TinyModelConfig(family=request.param, seed=3)
    return str(save_tiny_model(tmp_path_factory.mktemp(request.param) / "model", config))


def generate(path: str, prompts, temperature: float = 1.0, max_tokens: int = 24, **engine):
    settings = {"max_num_seqs": 64, "max_model_len": 128, **engine}
    rollout = NativeRolloutEngine.from_pretrained(path, NativeEngineConfig(**settings))
    try:
        assert rollout.lean_decoder is None  # MoE runs HF's decoder with the KV cache plugged in
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
        requests = [RolloutRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
        return rollout.generate_batch(requests, timeout=300)
    finally:
        rollout.close()


def trainer_pass(path: str, prompts, completions, temperature: float = 1.0, **engine):
    """The trainer's response log-probs ``[B, R]``, the batch, and the engine (packed, fp32)."""
    trainer = TorchTrainEngine(
        EngineConfig(model_path=path, logprob_temperature=temperature, pad_tokens_to_multiple=16, **engine)
    )
    trainer.initialize()
    batch = Batch(sequence_tensors(prompts, completions, pad_id=0))
    outputs = trainer.forward_backward(batch, None, forward_only=True).outputs
    return response_part(outputs.log_probs, batch["prompts"].shape[1]), batch, trainer


def test_rollout_log_probs_equal_the_trainers(moe_dir):
    prompts = random_prompts(12, 7, high=20)
    completions = generate(moe_dir, prompts, temperature=1.0)
    trainer, batch, _ = trainer_pass(moe_dir, prompts, completions)
    mask = batch["response_mask"].bool()
    deltas = (batch["rollout_log_probs"] - trainer)[mask]
    assert deltas.numel() > 150
    assert deltas.abs().max() <= 1e-5, float(deltas.abs().max())


def test_recorded_routing_covers_every_fed_token_and_equals_the_hf_engine(moe_dir):
    prompts = random_prompts(4, 11, high=20)
    native = generate(moe_dir, prompts, temperature=0.0, max_tokens=12)
    hf = HFRolloutEngine(load_model(moe_dir), load_tokenizer(moe_dir))
    reference = hf.generate_batch(
        [
            RolloutRequest(f"h{i}", p, SamplingParams(temperature=0.0, max_tokens=12))
            for i, p in enumerate(prompts)
        ]
    )
    layers = load_model(moe_dir).config.num_hidden_layers
    for ours, theirs in zip(native, reference, strict=True):
        assert ours.token_ids == theirs.token_ids
        total = len(ours.prompt_ids) + len(ours.token_ids)
        assert ours.routed_experts.shape == (total, layers, 2) and ours.routed_experts.dtype == torch.int16
        assert (ours.routed_experts[:-1] >= 0).all() and (
            ours.routed_experts[-1] == -1
        ).all()  # last: never fed
        assert torch.equal(ours.routed_experts, theirs.routed_experts)


def test_shared_prompts_and_prefix_cache_carry_the_prompts_routing(moe_dir):
    prompt = random_prompts(1, 5, low=10, high=20)[0]
    alone = generate(moe_dir, [prompt], temperature=0.0, max_tokens=4)[0]
    shared = generate(moe_dir, [prompt] * 3, temperature=0.0, max_tokens=4, prefix_cache_entries=4)
    for completion in shared:
        assert torch.equal(completion.routed_experts, alone.routed_experts)


def test_replayed_routing_leaves_matching_log_probs_and_no_disagreement(moe_dir):
    """fp32 rollout, fp32 trainer: replaying the rollout's routing changes nothing; the live
    routing agrees with it (disagreement 0)."""
    prompts = random_prompts(8, 3, high=20)
    completions = generate(moe_dir, prompts)
    live, batch, _ = trainer_pass(moe_dir, prompts, completions)
    replayed, _, trainer = trainer_pass(moe_dir, prompts, completions, router_replay="rollout")
    mask = batch["response_mask"].bool()
    assert (replayed - batch["rollout_log_probs"])[mask].abs().max() <= 1e-5
    assert torch.equal(replayed, live)
    result = trainer.forward_backward(
        batch, lambda micro, out: (out.log_probs.sum() * 0, {}), forward_only=True
    )
    assert result.metrics["moe/routing_disagreement"] == [0.0]
    assert 0.0 < result.metrics["moe/load_entropy"][0] <= 1.0


def test_bf16_rollout_routing_disagrees_until_replayed(tmp_path):
    """Near-tied router logits (router weights scaled down): a bf16 rollout routes some tokens
    differently from the fp32 trainer; replay makes the trainer run the rollout's experts."""
    path = save_tiny_model(tmp_path / "moe", TinyModelConfig(family="qwen3_moe", seed=1))
    model = load_model(path)
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.data.mul_(0.02)
    model.save_pretrained(path)
    prompts = random_prompts(16, 9, high=24)
    completions = generate(str(path), prompts, dtype="bfloat16")
    batch = Batch(sequence_tensors(prompts, completions, pad_id=0))
    loss = lambda micro, out: (out.log_probs.sum() * 0, {})  # noqa: E731
    disagreement = {}
    for replay in ("off", "rollout"):
        config = EngineConfig(
            model_path=str(path), router_replay=replay, share_prompts=False, pad_tokens_to_multiple=1
        )
        trainer = TorchTrainEngine(config)
        trainer.initialize()
        trainer.forward_backward(batch, loss, forward_only=True)
        calls = trainer.routing.tap.calls
        used = torch.stack([calls[layer].used for layer in range(len(calls))], 1).sort(-1).values
        recorded, real = packed_recorded(batch)
        disagreement[replay] = float((used[real] != recorded[real]).any(-1).float().mean())
    assert disagreement["off"] > 0.0
    assert disagreement["rollout"] == 0.0


def packed_recorded(batch: Batch):
    """The batch's recorded routing in packed token order ``[T, L, k]`` (sorted within k), and
    which packed tokens were routed by the rollout (one micro-batch, no fillers)."""
    mask = batch["attention_mask"].bool()
    recorded = batch["routed_experts"][mask].long().sort(-1).values
    return recorded, (recorded >= 0).all(-1).all(-1)
