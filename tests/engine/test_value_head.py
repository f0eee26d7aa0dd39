"""The critic's engine (``engine.head=value``): per-token values equal a plain forward of the HF
token classifier read one position back (padded, packed, micro-batched), and training on the
clipped value loss fits fixed targets."""

import functools

import pytest
import torch

from tandem.algos import LossNormalizer, compute_value_loss
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import save_tiny_model
from tandem.models.loading import load_value_model
from tests.engine.bf16_cpu import needs_bf16_cpu
from tests.engine.conftest import random_batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("value") / "model"))


def value_engine(model_dir: str, **settings) -> TorchTrainEngine:
    engine = TorchTrainEngine(EngineConfig(model_path=model_dir, head="value", lr=1e-2, **settings))
    engine.initialize()
    return engine


@pytest.mark.parametrize(
    "settings",
    [
        dict(use_packing=False, micro_batch_size=3),
        dict(use_packing=True, max_tokens_per_micro_batch=4096),
        dict(use_packing=True, max_tokens_per_micro_batch=64),
    ],
    ids=["padded", "packed", "packed-micro-batches"],
)
def test_values_equal_a_plain_forward_of_the_classifier(model_dir, settings):
    torch.manual_seed(0)
    engine = value_engine(model_dir, **settings)
    batch = random_batch(3, batch=6, length=20, vocab=50)
    values = engine.forward_backward(batch, None, forward_only=True).outputs
    assert values.log_probs is None and values.values is not None
    head = engine.causal_lm.score.weight.detach().clone()
    reference = load_value_model(model_dir)
    reference.score.weight.data.copy_(head)  # the same (freshly drawn) head
    expected = torch.zeros(batch["input_ids"].shape)
    with torch.no_grad():
        for row, (ids, mask) in enumerate(zip(batch["input_ids"], batch["attention_mask"], strict=True)):
            positions = mask.nonzero().flatten()
            scores = reference(input_ids=ids[positions].unsqueeze(0)).logits[0, :, 0].float()
            expected[row, positions[1:]] = scores[:-1]
    torch.testing.assert_close(values.values, expected, atol=1e-5, rtol=1e-4)


def test_the_clipped_value_loss_fits_fixed_targets(model_dir):
    engine = value_engine(model_dir)
    batch = random_batch(4, batch=6, length=16, vocab=50)
    mask = batch["loss_mask"]
    targets = torch.linspace(-1, 1, 6)[:, None].expand_as(mask).float() * mask
    old = engine.forward_backward(batch, None, forward_only=True).outputs.values.detach()

    def loss_fn(micro, outputs):
        loss, metrics = compute_value_loss(
            outputs.values, micro["returns"], micro["old_values"], micro["loss_mask"], None, "token-mean",
            LossNormalizer.from_mask(batch["loss_mask"]),
        )  # fmt: skip
        return loss, metrics

    batch = batch.assign(tensors={"returns": targets, "old_values": old})
    losses = []
    for _ in range(30):
        losses.append(engine.forward_backward(batch, functools.partial(loss_fn)).loss)
        engine.optimizer_step()
    assert losses[-1] < 0.2 * losses[0]


def test_a_value_head_has_no_token_distribution(model_dir):
    engine = value_engine(model_dir)
    with pytest.raises(ValueError, match="with_sum_pi_squared"):
        engine.forward_backward(random_batch(0, vocab=50), None, forward_only=True, with_sum_pi_squared=True)


@needs_bf16_cpu
def test_the_value_head_stays_fp32_under_bf16_autocast(model_dir):
    """With ``mixed_precision=bf16`` outside FSDP2 the decoder runs under autocast, but the
    head computes in fp32 (as the policy's does): the values equal the head applied in fp32 to
    the bf16 decoder's hidden states, not their bf16 rounding."""
    engine = value_engine(
        model_dir, use_packing=True, max_tokens_per_micro_batch=4096, mixed_precision="bf16"
    )
    batch = random_batch(3, batch=4, length=20, vocab=50)
    values = engine.forward_backward(batch, None, forward_only=True).outputs.values
    assert values.dtype == torch.float32
    rounded = values.to(torch.bfloat16).float()
    assert not torch.equal(values, rounded)  # carries more than bf16's 8 significant bits
