"""The engine's ``sum_pi_squared`` (packed, padded, shared-prompt packing, micro-batched) equals
``sum_v softmax(logits / T)_v^2`` computed directly from the HF model's logits."""

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.protocol import Batch
from tests.engine.conftest import random_batch

TEMPERATURE = 0.7


def tiny_model():
    return build_tiny_model(TinyModelConfig(family="qwen2"), 103, 0, 1, 4)  # the same weights each time


def direct_sum_pi_squared(batch: Batch) -> torch.Tensor:
    """``[B, S]``: at each valid token but a row's first, ``sum_v p(v)^2`` of the distribution that
    predicted it, from one plain forward per row over its valid tokens."""
    model = tiny_model()
    out = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for row, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"], strict=True)):
            positions = mask.nonzero().flatten()
            logits = model(input_ids=ids[positions].unsqueeze(0)).logits[0].float() / TEMPERATURE
            probs = torch.softmax(logits, dim=-1)
            out[row, positions[1:]] = probs.square().sum(-1)[:-1]
    return out


@pytest.mark.parametrize(
    "engine_settings",
    [
        dict(use_packing=False, micro_batch_size=3),
        dict(use_packing=True, max_tokens_per_micro_batch=4096),
        dict(use_packing=True, max_tokens_per_micro_batch=64),  # several micro-batches
    ],
    ids=["padded", "packed", "packed-micro-batches"],
)
def test_sum_pi_squared_equals_a_direct_softmax(engine_settings):
    engine = TorchTrainEngine(
        EngineConfig(logprob_temperature=TEMPERATURE, **engine_settings), model=tiny_model()
    )
    engine.initialize()
    batch = random_batch(2, batch=6, length=20)
    outputs = engine.forward_backward(batch, None, forward_only=True, with_sum_pi_squared=True).outputs
    expected = direct_sum_pi_squared(batch)
    predicted = expected > 0
    assert predicted.sum() > 40 and (expected[predicted] < 1).all()
    torch.testing.assert_close(outputs.sum_pi_squared, expected, atol=1e-5, rtol=1e-4)
    plain = engine.forward_backward(batch, None, forward_only=True).outputs
    assert plain.sum_pi_squared is None
    torch.testing.assert_close(plain.log_probs, outputs.log_probs)


def test_shared_prompt_packing_gives_the_same_sum_pi_squared():
    """Rows that share a prompt are packed with the prompt once (only response tokens get values);
    the statistic of the response tokens is unchanged."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(6, 103, (5,), generator=gen)
    responses = torch.randint(6, 103, (4, 6), generator=gen)
    lengths = torch.tensor([6, 3, 5, 1])
    response_mask = (torch.arange(6) < lengths[:, None]).long()
    prompts = prompt.repeat(4, 1)
    batch = Batch(
        {
            "prompts": prompts,
            "input_ids": torch.cat([prompts, responses * response_mask], 1),
            "attention_mask": torch.cat([torch.ones(4, 5, dtype=torch.long), response_mask], 1),
        }
    )
    results = []
    for share in (True, False):
        engine = TorchTrainEngine(
            EngineConfig(logprob_temperature=TEMPERATURE, use_packing=True, share_prompts=share),
            model=tiny_model(),
        )
        engine.initialize()
        results.append(
            engine.forward_backward(batch, None, forward_only=True, with_sum_pi_squared=True).outputs
        )
    response = slice(prompts.shape[1], None)
    expected = direct_sum_pi_squared(batch)[:, response]
    for outputs in results:
        torch.testing.assert_close(outputs.sum_pi_squared[:, response], expected, atol=1e-5, rtol=1e-4)
