"""The native engine over the trainer's own weight tensors, and its prepacked copies released between
generations: each against the old path (a copy of the weights, packs kept), bit for bit."""

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.protocol import Batch
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.rollout.shared_weights import share_named_tensors


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    """A tiny Llama with tied embedding and head (as SmolLM2's)."""
    config = TinyModelConfig(family="llama", tie_word_embeddings=True, seed=5)
    return str(save_tiny_model(tmp_path_factory.mktemp("tied") / "model", config))


def native(path: str) -> NativeRolloutEngine:
    return NativeRolloutEngine.from_pretrained(path, NativeEngineConfig(max_num_seqs=8, max_model_len=64))


def generate(engine: NativeRolloutEngine, seed: int = 0) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """Sampled token ids and log-probs of four requests (temperature 1, seeded)."""
    requests = [
        RolloutRequest(
            f"r{i}", (5 + i, 17, 30 + i), SamplingParams(temperature=1.0, max_tokens=12, seed=seed + i)
        )
        for i in range(4)
    ]
    return [(tuple(c.token_ids), tuple(c.log_probs)) for c in engine.generate_batch(requests)]


def trained(path: str) -> TorchTrainEngine:
    """A trainer engine over ``path`` after one optimizer step with a large learning rate."""
    engine = TorchTrainEngine(EngineConfig(model_path=path, lr=1e-2, max_tokens_per_micro_batch=64))
    engine.initialize()
    ids = torch.tensor([[5, 17, 30, 41, 52, 63]])
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    engine.forward_backward(batch, lambda micro, out: (-out.log_probs.sum(), {}))
    engine.optimizer_step()
    return engine


def test_an_engine_sharing_the_trainers_tensors_generates_as_one_holding_a_copy(tied_dir):
    trainer = TorchTrainEngine(EngineConfig(model_path=tied_dir, lr=1e-2, max_tokens_per_micro_batch=64))
    trainer.initialize()
    shared, copied = native(tied_dir), native(tied_dir)
    try:
        assert shared.share_weights(trainer.iter_parameters()) == len(list(trainer.causal_lm.parameters()))
        actor = {name: p.data_ptr() for name, p in trainer.causal_lm.named_parameters()}
        assert {name: p.data_ptr() for name, p in shared.model.named_parameters()} == actor
        head = shared.model.get_output_embeddings().weight
        assert head is shared.model.get_input_embeddings().weight  # still tied
        ids = torch.tensor([[5, 17, 30, 41, 52, 63]])
        batch = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        trainer.forward_backward(batch, lambda micro, out: (-out.log_probs.sum(), {}))
        trainer.optimizer_step()  # in place: the shared engine holds the new weights already
        before = generate(copied)
        assert shared.update_weights(trainer.iter_parameters(), version=1) == len(actor)
        copied.update_weights(trainer.iter_parameters(), version=1)  # the old path: copy them in
        after = generate(copied)
        assert after != before  # the step changed what is generated
        assert generate(shared) == after  # ids and log-probs, bit for bit
    finally:
        shared.close()
        copied.close()


def test_a_tensor_that_cannot_be_shared_is_copied_and_ties_survive():
    model = torch.nn.Sequential(torch.nn.Embedding(7, 4), torch.nn.Linear(4, 7, bias=False))
    model[1].weight = model[0].weight  # tied
    bf16 = torch.randn(7, 4).to(torch.bfloat16)
    assert share_named_tensors(model, [("0.weight", bf16)]) == 0  # another dtype: copied in
    assert model[1].weight is model[0].weight
    assert torch.equal(model[0].weight, bf16.float())
    fp32 = torch.randn(7, 4)
    assert share_named_tensors(model, [("0.weight", fp32)]) == 1
    assert model[0].weight.data_ptr() == fp32.data_ptr() and model[1].weight is model[0].weight


def test_released_packs_come_back_for_the_next_step_with_the_same_tokens(tied_dir):
    engine = native(tied_dir)
    try:
        packs = engine.prepacked_weights
        assert packs > 0
        first = generate(engine)
        engine.release_packed_weights()
        assert engine.prepacked_weights == 0
        assert generate(engine) == first  # packed again before the first step
        assert engine.prepacked_weights == packs
    finally:
        engine.close()


def test_weights_synced_while_packs_are_released_generate_as_the_old_path(tied_dir):
    """The colocated order: generate, release, update, sync, generate; against packs kept throughout."""
    trainer = trained(tied_dir)
    released, kept = native(tied_dir), native(tied_dir)
    try:
        released.share_weights(trainer.iter_parameters())
        generate(released), generate(kept)
        released.release_packed_weights()
        released.update_weights(trainer.iter_parameters(), version=1)
        kept.update_weights(trainer.iter_parameters(), version=1)
        assert released.prepacked_weights == kept.prepacked_weights
        assert generate(released, seed=9) == generate(kept, seed=9)
        released.sleep()  # asleep: a sync defers packing to the next step
        released.update_weights(trainer.iter_parameters(), version=2)
        assert released.prepacked_weights == 0
        released.wake()
        kept.update_weights(trainer.iter_parameters(), version=2)
        assert generate(released, seed=11) == generate(kept, seed=11)
    finally:
        released.close()
        kept.close()
