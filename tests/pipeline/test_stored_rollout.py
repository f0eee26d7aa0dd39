"""A rank's generated rows kept in the store (``store_rollout``) and trimmed by reference
(``trim_stored``) materialise as the controller's ``trim_padding`` of the same rows would, bit for
bit, and carry the decoded texts and lengths inline."""

import torch

from tandem.dataplane import BatchRef, ShmStore
from tandem.models.tokenizer import build_char_tokenizer
from tandem.pipeline.stored_rollout import LAST_SAMPLED, RESPONSE_TEXT, store_rollout, trim_stored
from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import (
    decode_responses,
    last_sampled_token,
    resize_columns,
    response_lengths,
    sequence_tensors,
    trim_padding,
)

PAD = 0


def generated(
    prompts: list[list[int]], responses: list[list[int]], prompt_width: int, max_tokens: int
) -> Batch:
    """What ``generate_sequences`` returns for these rows: padded to the request's widths."""
    completions = [
        Completion(f"r{i}", tuple(p), r, [-0.5 - j for j in range(len(r))], [3] * len(r), "length")
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True))
    ]
    tensors = resize_columns(sequence_tensors(prompts, completions, PAD), prompt_width, max_tokens, PAD)
    columns = {"prompt_ids": prompts, "uid": [f"u{i // 2}" for i in range(len(prompts))]}
    return Batch(tensors, {**columns, "finish_reason": ["length"] * len(prompts)})


def test_stored_and_trimmed_rows_materialise_as_the_trimmed_batch(tmp_path):
    tokenizer = build_char_tokenizer()
    ids = tokenizer("abcdefgh")["input_ids"]
    # two "ranks", each padded to the request's widths (8 prompt, 7 response columns)
    one = generated([ids[:3], ids[:2]], [ids[1:4], ids[2:3]], 8, 7)
    two = generated([ids[:4], ids[:1]], [ids[:2], []], 8, 7)
    store = ShmStore(str(tmp_path))
    ref = trim_stored(
        BatchRef.concat([store_rollout(one, store, tokenizer), store_rollout(two, store, tokenizer)])
    )

    expected = trim_padding(Batch.concat([one, two]), PAD)  # the controller's batch today
    got = ref.materialise(store.get)
    for name, tensor in expected.tensors.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].dtype == tensor.dtype, name
    assert "prompt_ids" not in ref.scalars and "prompts" in ref.stored_fields()
    assert list(ref[RESPONSE_TEXT]) == decode_responses(
        tokenizer, expected["responses"], response_lengths(expected)
    )
    assert torch.equal(ref["response_length"], response_lengths(expected))
    assert torch.equal(ref[LAST_SAMPLED], last_sampled_token(expected["response_mask"]))
    assert list(ref["uid"]) == list(expected["uid"])
    ref.release(store.release)
    assert list(tmp_path.iterdir()) == []
