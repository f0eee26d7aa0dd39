"""A character-level tokenizer built locally with ``tokenizers``: no hub, fully reproducible.

It has ``<pad>``, ``<s>``, ``</s>`` and the ChatML markers ``<|im_start|>``/``<|im_end|>`` as
special tokens and a ChatML chat template, and is saved with ``save_pretrained`` so the
ordinary ``AutoTokenizer.from_pretrained(path)`` loads it like any hub tokenizer.

With ``vision=True`` it also has Qwen2-VL's vision markers (``<|vision_start|>``,
``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``, after every other id, so text ids are
the same) and a template that renders a message's content list: an ``{"type": "image"}`` part
becomes ``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen2-VL's own template does.
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
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer(vision: bool = False) -> PreTrainedTokenizerFast:
    """The character tokenizer (``len = 6 specials + 97 characters``, plus the 4 vision markers with
    ``vision``); unknown characters are an error on encode."""
    extra = VISION_TOKENS if vision else []
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + CHARACTERS + extra)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # Split every character into its own piece, newlines included (``.`` would leave a run of
    # newlines as one piece, not in the vocabulary); the special tokens are matched before this runs.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(SPECIAL_TOKENS + extra)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["</s>", "<|im_start|>", *extra],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = VISION_CHATML_TEMPLATE if vision else CHATML_TEMPLATE
    return fast
