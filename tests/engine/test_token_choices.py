"""The engine's top-k tokens and named tokens' log-probs (what distillation reads) against full
logits, packed against padded, values and gradients."""

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.engine.base import GATHER_FIELD
from tandem.engine.packing import positions_from_mask
from tandem.models import load_model
from tests.engine.conftest import random_batch

K = 3


def _engine(model_dir: str, **overrides) -> TorchTrainEngine:
    engine = TorchTrainEngine(EngineConfig(model_path=model_dir, lr=1e-2, micro_batch_size=3, **overrides))
    engine.initialize()
    return engine


def _with_named_tokens(batch, seed: int = 5):
    generator = torch.Generator().manual_seed(seed)
    shape = (*batch["input_ids"].shape, K)
    return batch.assign(tensors={GATHER_FIELD: torch.randint(0, 103, shape, generator=generator)})


def _reference_log_probs(model_dir: str, batch) -> torch.Tensor:
    """``log_softmax`` of the HF model's logits, ``[B, S, V]``: position ``t`` predicts token ``t``."""
    model = load_model(model_dir)
    mask = batch["attention_mask"]
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=mask, position_ids=positions_from_mask(mask)).logits
    shifted = torch.zeros_like(logits)
    shifted[:, 1:] = logits[:, :-1]
    return torch.log_softmax(shifted.float(), -1)


@pytest.mark.parametrize("use_packing", [True, False])
def test_top_k_and_named_tokens_equal_the_full_distribution(tiny_model_dir, use_packing):
    batch = _with_named_tokens(random_batch(0))
    outputs = (
        _engine(tiny_model_dir, use_packing=use_packing)
        .forward_backward(batch, None, forward_only=True, top_k=K)
        .outputs
    )
    reference = _reference_log_probs(tiny_model_dir, batch)
    mask = batch["attention_mask"].bool()
    predicted = mask.clone()
    predicted[:, 0] = False
    predicted &= torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], 1)  # a token before it
    values, ids = reference.topk(K, dim=-1)
    torch.testing.assert_close(outputs.top_log_probs[predicted], values[predicted], rtol=0, atol=1e-5)
    assert torch.equal(outputs.top_ids[predicted], ids[predicted])
    assert outputs.top_ids.dtype == torch.int64
    named = reference.gather(-1, batch[GATHER_FIELD])
    torch.testing.assert_close(outputs.gathered_log_probs[predicted], named[predicted], rtol=0, atol=1e-5)
    assert torch.all(outputs.gathered_log_probs[~predicted] == 0) and torch.all(
        outputs.top_ids[~predicted] == 0
    )


def test_named_tokens_log_probs_train_the_same_packed_and_padded(tiny_model_dir):
    batch = _with_named_tokens(random_batch(1))

    def loss_fn(micro, outputs):
        weights = micro["loss_mask"].float()[..., None]
        return -(outputs.gathered_log_probs * weights).sum() / 100.0, {}

    gradients = []
    for use_packing in (True, False):
        engine = _engine(tiny_model_dir, use_packing=use_packing)
        engine.forward_backward(batch, loss_fn)
        gradients.append(
            {n: p.grad.clone() for n, p in engine.module.named_parameters() if p.grad is not None}
        )
    packed, padded = gradients
    assert packed.keys() == padded.keys() and packed
    for name in packed:
        torch.testing.assert_close(packed[name], padded[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in packed.values())
