"""Incremental detokenisation against decoding the whole sequence at once."""

import random

import pytest

from tandem.models import build_char_tokenizer
from tandem.serve.text import IncrementalText, final_text

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def pushed_one_by_one(tokenizer, token_ids, stop=()):
    text = IncrementalText(tokenizer, stop)
    pieces = [text.push([t]) for t in token_ids]
    return "".join(pieces) + text.finish(), pieces


@pytest.mark.parametrize("seed", range(5))
def test_deltas_concatenate_to_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(60)]
    streamed, _ = pushed_one_by_one(tokenizer, ids)
    assert streamed == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("stop", [("lo w",), ("o",), ("xyz", "wor"), ("d!",)])
def test_stop_strings_cut_like_str_find_on_the_whole_text(tokenizer, stop):
    ids = tokenizer.encode("hello world! more text", add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    cut = min(i for i in (whole.find(s) for s in stop) if i >= 0)
    streamed, pieces = pushed_one_by_one(tokenizer, ids, stop)
    assert streamed == whole[:cut] == final_text(tokenizer, ids, stop)
    assert not any(s in streamed for s in stop)


def test_no_stop_string_prefix_escapes_before_the_end(tokenizer):
    """A partial stop string is held back, then released once the response ends without it."""
    ids = tokenizer.encode("abc wo", add_special_tokens=False)
    text = IncrementalText(tokenizer, ("world",))
    emitted = "".join(text.push([t]) for t in ids)
    assert emitted == "ab"  # "c wo" (4 = len("world") - 1 characters) could still become "world"
    assert emitted + text.finish() == "abc wo"


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE whose tokens split multi-byte characters (é, 日本, emoji) across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["hello world, café crème", "the quick brown fox", "plain ascii words only"] * 20
    tokenizer.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


@pytest.mark.parametrize("text", ["café 日本語 🙂 done", "naïve résumé", "🙂🙂 ok"])
def test_split_characters_are_held_until_complete(byte_tokenizer, text):
    ids = byte_tokenizer.encode(text, add_special_tokens=False)
    # some prefix ends inside a character: the case the incremental decoder must hold back
    assert any(byte_tokenizer.decode(ids[:i]).endswith("\ufffd") for i in range(1, len(ids)))
    streamed, pieces = pushed_one_by_one(byte_tokenizer, ids)
    assert streamed == byte_tokenizer.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    cut_short = ids[:-1]  # a response that ends mid-character still returns what it decodes to
    assert pushed_one_by_one(byte_tokenizer, cut_short)[0] == byte_tokenizer.decode(cut_short)
