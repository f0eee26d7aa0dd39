"""A character-level tokenizer built locally with ``tokenizers``: no hub, fully reproducible.

It has ``<pad>``, ``<s>``, ``</s>`` and the ChatML markers ``<|im_start|>``/``<|im_end|>`` as
special tokens and a ChatML chat template, and is saved with ``save_pretrained`` so the
ordinary ``AutoTokenizer.from_pretrained(path)`` loads it like any hub tokenizer.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CHARACTERS = list(string.printable[:95]) + ["\n", "\t"]  # digits, letters, punctuation, space, newline, tab
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer (``len = 5 specials + 97 characters``); unknown characters are an error on encode."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # Split every character into its own piece, newlines included (``.`` would leave a run of
    # newlines as one piece, not in the vocabulary); the special tokens are matched before this runs.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["</s>", "<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast
