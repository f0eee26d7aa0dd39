"""Engine behaviours: checkpoint resume equals an uninterrupted step, LoRA reference log-probs, schedules, errors."""

import functools
import math

import pytest
import torch

from tandem.engine import EngineConfig, LoraConfig, TorchTrainEngine
from tandem.engine.lr_schedule import lr_multiplier
from tandem.engine.step_outputs import read_back
from tandem.models import load_model
from tandem.protocol import Batch
from tandem.sft.loss import sft_loss
from tests.engine.conftest import random_batch


def make_engine(model_dir: str, **overrides) -> TorchTrainEngine:
    engine = TorchTrainEngine(EngineConfig(model_path=model_dir, lr=1e-2, **overrides))
    engine.initialize()
    return engine


def train_step(engine: TorchTrainEngine, batch: Batch) -> float:
    normalizer = engine.global_normalizer(batch["loss_mask"])
    engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
    norm = engine.optimizer_step()
    engine.lr_step()
    return norm


def params(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.iter_parameters()}


def test_checkpoint_resume_equals_uninterrupted(tiny_model_dir, tmp_path):
    schedule = {"lr_schedule": "cosine", "warmup_steps": 1, "total_steps": 5}
    batches = [random_batch(seed) for seed in range(3)]
    uninterrupted = make_engine(tiny_model_dir, **schedule)
    for batch in batches:
        train_step(uninterrupted, batch)

    first = make_engine(tiny_model_dir, **schedule)
    train_step(first, batches[0])
    first.save(str(tmp_path / "ckpt"))
    resumed = make_engine(tiny_model_dir, **schedule)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step_count == 1 and resumed.lr == first.lr
    for batch in batches[1:]:
        train_step(resumed, batch)
    expected = params(uninterrupted)
    for name, tensor in params(resumed).items():
        assert torch.equal(tensor, expected[name]), name


def test_save_replaces_a_checkpoint_atomically(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir)
    engine.save(str(tmp_path / "ckpt"))
    engine.save(str(tmp_path / "ckpt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp or .old left behind
    with pytest.raises(FileNotFoundError, match="no engine checkpoint"):
        engine.load(str(tmp_path / "missing"))


def test_lora_reference_log_probs_equal_the_base_model(tiny_model_dir):
    batch = random_batch(4)
    base = make_engine(tiny_model_dir)
    base_log_probs = base.forward_backward(batch, None, forward_only=True).outputs.log_probs
    lora = make_engine(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8))
    trainable = sum(p.numel() for p in lora.causal_lm.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in lora.causal_lm.parameters()) / 5
    for seed in range(3):  # move the adapter away from its identity start
        train_step(lora, random_batch(10 + seed))
    policy = lora.forward_backward(batch, None, forward_only=True).outputs.log_probs
    with lora.adapter_disabled():
        reference = lora.forward_backward(batch, None, forward_only=True).outputs.log_probs
    assert (policy - base_log_probs).abs().max() > 1e-3  # the adapter changed the policy
    torch.testing.assert_close(reference, base_log_probs, atol=1e-6, rtol=0)


def test_lora_merged_parameters_match_peft_merge(tiny_model_dir):
    lora = make_engine(tiny_model_dir, lora=LoraConfig(rank=4, alpha=8))
    train_step(lora, random_batch(5))
    merged = dict(lora.iter_parameters())
    expected = lora.causal_lm.merge_and_unload().state_dict()
    assert merged.keys() == {k for k in expected if k in merged} and len(merged) == len(
        list(load_model(tiny_model_dir).parameters())
    )
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], msg=name)


def test_grad_norm_is_the_global_l2_norm_and_clipping_applies(tiny_model_dir):
    engine = make_engine(tiny_model_dir, grad_clip=1e-3)
    batch = random_batch(6)
    normalizer = engine.global_normalizer(batch["loss_mask"])
    engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
    manual = torch.sqrt(sum(p.grad.double().square().sum() for p in engine.causal_lm.parameters()))
    before = params(engine)
    norm = engine.optimizer_step()
    assert abs(norm - float(manual)) < 1e-5 * float(manual)
    assert norm > 1e-3  # it was clipped: the step used gradients of norm 1e-3
    assert any(not torch.equal(before[n], t) for n, t in params(engine).items())


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedule_shapes(schedule):
    config = EngineConfig(lr_schedule=schedule, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    values = [lr_multiplier(step, config) for step in range(7)]
    assert values[:2] == [0.5, 1.0]
    if schedule == "constant":
        assert values[2:] == [1.0] * 5
    else:
        assert values[2] == 1.0 and abs(values[6] - 0.1) < 1e-12
        assert all(a >= b for a, b in zip(values[2:], values[3:], strict=False))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_warmup_from_zero_is_verl_s_schedule(schedule):
    """verl's schedules, written from its formula: warmup ``s / W``, then a half-cosine to ``min_lr_ratio``."""
    warmup, total, floor = 3, 9, 0.1

    def verl(step):
        if step < warmup:
            return step / warmup
        if schedule == "constant":
            return 1.0
        progress = (step - warmup) / (total - warmup)
        return max(floor, math.cos(math.pi * 0.5 * 2.0 * progress) * (1 - floor) * 0.5 + (1 + floor) * 0.5)

    config = EngineConfig(
        lr_schedule=schedule,
        warmup_steps=warmup,
        total_steps=total,
        min_lr_ratio=floor,
        warmup_from_zero=True,
    )
    for step in range(total + 1):
        assert abs(lr_multiplier(step, config) - verl(step)) < 1e-12, step


def test_offload_round_trip_keeps_training_identical(tiny_model_dir):
    a, b = make_engine(tiny_model_dir), make_engine(tiny_model_dir)
    train_step(a, random_batch(7))
    train_step(b, random_batch(7))
    b.offload()  # here the AdamW moments (the weights are memory-mapped: they stay); on a GPU all of it
    assert all(
        v.untyped_storage().nbytes() == 0 for s in b.optimizer.state.values() for v in s.values() if v.dim()
    )
    b.reload()
    train_step(a, random_batch(8))
    train_step(b, random_batch(8))
    pa = params(a)
    assert all(torch.equal(t, pa[n]) for n, t in params(b).items())


def test_bad_inputs_are_clear_errors(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_tokens_per_micro_batch=10)
    with pytest.raises(ValueError, match="needs input_ids and attention_mask"):
        engine.forward_backward(
            Batch({"input_ids": torch.ones(2, 3, dtype=torch.long)}), None, forward_only=True
        )
    with pytest.raises(ValueError, match="more than the micro-batch token budget of 10"):
        engine.forward_backward(random_batch(0), None, forward_only=True)
    with pytest.raises(ValueError, match="token id 500, but the model's vocabulary has 103 entries"):
        engine.forward_backward(
            Batch(
                {"input_ids": torch.full((1, 3), 500), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
            ),
            None,
            forward_only=True,
        )
    with pytest.raises(ValueError, match="needs a loss_fn"):
        engine.forward_backward(random_batch(0), None)
    with pytest.raises(ValueError, match="adapter_disabled\\(\\) needs LoRA"), engine.adapter_disabled():
        pass
    with pytest.raises(ValueError, match="engine.strategy='zero3'"):
        EngineConfig(strategy="zero3")
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed group"):
        TorchTrainEngine(EngineConfig(model_path=tiny_model_dir, strategy="ddp")).initialize()


def test_empty_responses_contribute_nothing(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    batch = random_batch(9)
    empty = batch.assign(tensors={"loss_mask": torch.zeros_like(batch["loss_mask"])})
    normalizer = engine.global_normalizer(empty["loss_mask"])
    result = engine.forward_backward(empty, functools.partial(sft_loss, normalizer=normalizer))
    assert result.loss == 0.0
    assert all(p.grad is None or p.grad.abs().max() == 0 for p in engine.causal_lm.parameters())


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir):
    grads = []
    for checkpointing in (False, True):
        engine = make_engine(tiny_model_dir, gradient_checkpointing=checkpointing)
        batch = random_batch(11)
        normalizer = engine.global_normalizer(batch["loss_mask"])
        engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
        grads.append({n: p.grad.clone() for n, p in engine.causal_lm.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_parameters_train_and_keep_fp32_log_probs(tiny_model_dir):
    fp32, bf16 = make_engine(tiny_model_dir), make_engine(tiny_model_dir, param_dtype="bfloat16")
    assert next(bf16.causal_lm.parameters()).dtype == torch.bfloat16
    batch = random_batch(12)
    reference = fp32.forward_backward(batch, None, forward_only=True).outputs.log_probs
    outputs = bf16.forward_backward(batch, None, forward_only=True).outputs.log_probs
    assert outputs.dtype == torch.float32
    torch.testing.assert_close(outputs, reference, atol=0.1, rtol=0.05)  # bf16 weights, fp32 head
    before = params(bf16)
    assert math.isfinite(train_step(bf16, batch))
    assert any(not torch.equal(before[n], t) for n, t in params(bf16).items())


def test_one_read_back_per_step_gives_the_per_micro_batch_floats():
    """The step's losses and metrics come back in one transfer, equal to reading each alone."""
    gen = torch.Generator().manual_seed(0)
    losses = [torch.randn((), generator=gen) for _ in range(5)]
    metrics = {
        "clip": [torch.rand((), generator=gen, dtype=torch.float64) for _ in range(5)],
        "count": [1, 2.5, torch.tensor(3), 4, torch.tensor([5.0])],  # plain numbers beside tensors
    }
    loss, floats = read_back(losses, metrics)
    expected = 0.0
    for value in losses:
        expected += float(value)
    assert loss == expected
    assert floats == {name: [float(v) for v in values] for name, values in metrics.items()}
    assert read_back([], {"plain": [1, 2]}) == (0.0, {"plain": [1.0, 2.0]})
