"""``routed_experts [B, S, L, k]``: placed like the tokens, resized and concatenated like
``input_ids``, packed like the tokens (packed ≡ padded), through the sample store intact."""

import torch

from tandem.engine.packing import pack_per_token, pack_sequences, pad_to_multiple, unpack
from tandem.engine.shared_prompts import pack_shared_prompts
from tandem.pipeline.sample_store import InlineWriter, SampleWriter, read_fields
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import concat_sequences, resize_columns, sequence_tensors


def completion(prompt, tokens, seed):
    routed = torch.randint(
        0, 4, (len(prompt) + len(tokens), 3, 2), generator=torch.Generator().manual_seed(seed)
    )
    routed[-1] = -1
    return Completion(f"c{seed}", tuple(prompt), list(tokens), [0.0] * len(tokens), [0] * len(tokens),
                      "stop", routed_experts=routed.to(torch.int16))  # fmt: skip


def generation_batch():
    prompts = [[5, 6, 7], [8], [9, 10]]
    completions = [completion(prompts[0], [11, 12], 0), completion(prompts[1], [13, 14, 15, 16], 1),
                   completion(prompts[2], [17], 2)]  # fmt: skip
    return prompts, completions, sequence_tensors(prompts, completions, pad_id=0)


def test_routing_sits_under_its_tokens_with_minus_one_on_padding():
    prompts, completions, tensors = generation_batch()
    routed, mask = tensors["routed_experts"], tensors["attention_mask"].bool()
    assert routed.shape == (3, 3 + 4, 3, 2) and routed.dtype == torch.int16
    for row, c in enumerate(completions):
        assert torch.equal(routed[row][mask[row]], c.routed_experts)
    assert (routed[~mask] == -1).all()


def test_resize_and_concat_move_routing_with_input_ids():
    prompts, completions, tensors = generation_batch()
    wider = resize_columns(tensors, 5, 6, pad_id=0)
    mask = wider["attention_mask"].bool()
    assert wider["routed_experts"].shape[1] == wider["input_ids"].shape[1] == 11
    assert torch.equal(
        wider["routed_experts"][mask], tensors["routed_experts"][tensors["attention_mask"].bool()]
    )
    joined = concat_sequences([Batch(tensors), Batch(resize_columns(tensors, 4, 4, 0))], pad_id=0)
    assert joined["routed_experts"].shape[:2] == joined["input_ids"].shape


def test_packed_routing_equals_the_padded_routing():
    _, _, tensors = generation_batch()
    ids, mask, routed = tensors["input_ids"], tensors["attention_mask"], tensors["routed_experts"]
    for packed in (pack_sequences(ids, mask), pack_shared_prompts(ids, mask, 3)):
        packed = pad_to_multiple(packed, 8)
        row = pack_per_token(routed, packed, fill=-1)  # [1, T, L, k]
        assert row.shape == (1, packed.num_tokens, 3, 2)
        # each packed token carries the routing of the padded token it copies
        sources = packed.flat_index if packed.source_index is None else packed.source_index
        real = sources.numel()
        assert torch.equal(row[0, :real], routed.flatten(0, 1)[sources])
        assert torch.equal(packed.input_ids[0, :real], ids.flatten()[sources])
        assert (row[0, real:] == -1).all()  # fillers
        # and the tokens whose outputs come back (unpack) carry their own row's routing
        for layer in range(3):
            back = unpack(row[0, :, layer, 0], packed, fill=-1)
            placed = back != -1
            assert torch.equal(back[placed], routed[..., layer, 0][placed])


def test_routing_survives_the_sample_store(tmp_path):
    _, completions, _ = generation_batch()
    tensors = {
        "routed_experts": torch.cat([c.routed_experts for c in completions]),
        "routed_lengths": torch.tensor([len(c.routed_experts) for c in completions]),
    }
    for writer in (SampleWriter(str(tmp_path)), InlineWriter()):
        out = read_fields(writer.write("g", tensors))
        assert out["routed_experts"].dtype == torch.int16
        assert torch.equal(out["routed_experts"], tensors["routed_experts"])
