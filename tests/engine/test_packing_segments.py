"""Rows that hold several sequences end to end (an agent program's split episode): packed with
their restarting ``position_ids``, each segment's log-probs equal the same segment run as a row
of its own; the padded forward refuses such rows, naming the key."""

import pytest
import torch

from tandem.engine import EngineConfig, TorchTrainEngine, pack_sequences, unpack
from tandem.engine.packing import restarts_within_rows
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.protocol import Batch

VOCAB = 103
PROMPT = 4  # prompt columns of the segmented batch


def engine_for(**overrides) -> TorchTrainEngine:
    model = build_tiny_model(TinyModelConfig(family="qwen2"), VOCAB, 0, 1, 4)
    engine = TorchTrainEngine(EngineConfig(**overrides), model=model)
    engine.initialize()
    return engine


def segments() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=generator).tolist() for n in (7, 9, 5)]


def segmented_row(parts: list[list[int]], pad_front: int = 1, pad_back: int = 3) -> Batch:
    """One row: ``parts`` end to end (the first ``PROMPT - pad_front`` tokens in the prompt
    columns), its positions restarting at 0 where each part starts, padded on both sides."""
    tokens = [t for part in parts for t in part]
    positions = [p for part in parts for p in range(len(part))]
    ids = [0] * pad_front + tokens + [0] * pad_back
    mask = [0] * pad_front + [1] * len(tokens) + [0] * pad_back
    places = [0] * pad_front + positions + [0] * pad_back
    return Batch(
        {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.tensor([mask]),
            "position_ids": torch.tensor([places]),
            "prompts": torch.tensor([ids[:PROMPT]]),
        }
    )


def separate_rows(parts: list[list[int]]) -> Batch:
    """Each of ``parts`` as a row of its own (right-padded)."""
    width = max(len(p) for p in parts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in parts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in parts])
    return Batch({"input_ids": ids, "attention_mask": mask})


def test_packing_splits_a_row_where_its_positions_restart():
    row = segmented_row(segments())
    packed = pack_sequences(row["input_ids"], row["attention_mask"], row["position_ids"])
    assert packed.cu_seqlens.tolist() == [0, 7, 16, 21]
    assert packed.position_ids[0].tolist() == [*range(7), *range(9), *range(5)]
    # unpacking puts the values back in the row; no prediction crosses a segment start
    torch.testing.assert_close(unpack(packed.input_ids, packed), row["input_ids"] * row["attention_mask"])
    assert restarts_within_rows(row["position_ids"], row["attention_mask"])
    plain = separate_rows(segments())
    positions = (plain["attention_mask"].cumsum(-1) - 1).clamp(min=0) * plain["attention_mask"]
    assert not restarts_within_rows(positions, plain["attention_mask"])
    # rows without restarts pack exactly as without positions
    with_positions = pack_sequences(plain["input_ids"], plain["attention_mask"], positions)
    without = pack_sequences(plain["input_ids"], plain["attention_mask"])
    assert torch.equal(with_positions.cu_seqlens, without.cu_seqlens)
    assert torch.equal(with_positions.position_ids, without.position_ids)


@pytest.mark.parametrize("share_prompts", [True, False])
def test_each_segment_of_a_row_gets_the_log_probs_it_gets_as_a_row_of_its_own(share_prompts):
    parts = segments()
    engine = engine_for(use_packing=True, share_prompts=share_prompts, max_tokens_per_micro_batch=4096)
    reference = engine.forward_backward(separate_rows(parts), None, forward_only=True).outputs
    # two copies of the row: rows with the same prompt columns would share their prompt's packing
    row = segmented_row(parts)
    both = Batch({k: torch.cat([row[k], row[k]]) for k in row.keys()})
    outputs = engine.forward_backward(both, None, forward_only=True).outputs
    mask = both["attention_mask"][0].bool()
    expected = torch.cat([reference.log_probs[i, : len(p)] for i, p in enumerate(parts)])
    for copy in range(2):
        got = outputs.log_probs[copy][mask]
        # a segment's first token is predicted by nothing (0), as a row's first token is
        assert (expected != 0).sum() == sum(len(p) - 1 for p in parts)
        assert torch.allclose(got, expected, atol=1e-6, rtol=0), float((got - expected).abs().max())
        entropy = torch.cat([reference.entropy[i, : len(p)] for i, p in enumerate(parts)])
        assert torch.allclose(outputs.entropy[copy][mask], entropy, atol=1e-6, rtol=0)


def test_the_padded_forward_refuses_a_row_of_several_sequences_naming_the_key():
    engine = engine_for(use_packing=False, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"actor\.engine\.use_packing=true"):
        engine.forward_backward(segmented_row(segments()), None, forward_only=True)
    # a batch of one sequence per row still runs padded (its positions are the mask's)
    plain = separate_rows(segments())
    positions = (plain["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    engine.forward_backward(plain.assign(tensors={"position_ids": positions}), None, forward_only=True)
