"""Stored draws join as DAPO's dynamic sampling joins them: each draw trimmed to its own widths
(``trim_stored``), some of its rows selected, the pieces concatenated (``concat_stored``) and cut
to the kept rows' widths materialise as the controller's ``concat_sequences`` + ``trim_padding``
of the same rows, bit for bit; ``rows_outside`` names exactly the rows whose blocks no kept row
shares (what the stage releases at once)."""

import pytest
import torch

from tandem.dataplane import ShmStore
from tandem.models.tokenizer import build_char_tokenizer
from tandem.pipeline.stored_rollout import concat_stored, rows_outside, store_rollout, trim_stored
from tandem.protocol.sequences import concat_sequences, trim_padding
from tests.pipeline.test_stored_rollout import PAD, generated


def test_selected_rows_of_stored_draws_join_as_the_controllers_batch(tmp_path):
    tokenizer = build_char_tokenizer()
    ids = tokenizer("abcdefgh")["input_ids"]
    # three draws stored at one width (8 prompt, 7 response columns), of different trimmed widths
    draws = [
        generated([ids[:3], ids[:2]], [ids[1:4], ids[2:3]], 8, 7),
        generated([ids[:6], ids[:1]], [ids[:6], []], 8, 7),
        generated([ids[:2], ids[:2]], [ids[:1], ids[:2]], 8, 7),
    ]
    store = ShmStore(str(tmp_path))
    refs = [trim_stored(store_rollout(draw, store, tokenizer)) for draw in draws]
    trimmed = [trim_padding(draw, PAD) for draw in draws]
    pick = [torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([0])]  # the informative rows, say

    expected = trim_padding(
        concat_sequences([b[i] for b, i in zip(trimmed, pick, strict=True)], PAD)[:2], PAD
    )
    pool = concat_stored([r[i] for r, i in zip(refs, pick, strict=True)])
    got = trim_stored(pool[:2])
    fetched = got.materialise(store.get)
    for name, tensor in expected.tensors.items():
        assert torch.equal(fetched[name], tensor) and fetched[name].dtype == tensor.dtype, name

    dropped = rows_outside(pool, got)  # rows 0 and 1 are draws 0 and 1: draw 2's block is unused
    assert len(dropped) == 1 and [b.path for b in dropped.blocks()] == [b.path for b in refs[2].blocks()]
    dropped.release(store.release)
    got.release(store.release)
    assert list(tmp_path.iterdir()) == []


def test_draws_stored_at_different_widths_are_refused_by_field(tmp_path):
    tokenizer = build_char_tokenizer()
    ids = tokenizer("abcdefgh")["input_ids"]
    store = ShmStore(str(tmp_path))
    narrow = store_rollout(generated([ids[:3]], [ids[:2]], 4, 7), store, tokenizer)
    wide = store_rollout(generated([ids[:3]], [ids[:2]], 8, 7), store, tokenizer)
    with pytest.raises(ValueError, match="stored draws of different widths cannot be joined: 'prompts'"):
        concat_stored([trim_stored(narrow), trim_stored(wide)])
    for ref in (narrow, wide):
        ref.release(store.release)
