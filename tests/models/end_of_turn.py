"""A tiny model directory laid out like an instruct checkpoint: its end-of-turn id is named only in
``generation_config.json`` (as Qwen2.5-Instruct's and Llama-3-Instruct's are)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.models import TinyModelConfig
from tandem.models.tiny import build_tiny_model
from tandem.models.tokenizer import build_char_tokenizer

END_OF_TEXT = "</s>"  # config.json's and the tokenizer's EOS (A)
END_OF_TURN = "<|im_end|>"  # named only in generation_config.json (B)
PROMPT_TEXT = "12+30="
TOKENS_BEFORE_END = 8


def save_end_of_turn_model(path: str | Path) -> Path:
    """Write the model and tokenizer to ``path``: ``config.json`` and the tokenizer say EOS is
    ``</s>``, ``generation_config.json`` says ``[</s>, <|im_end|>]``.

    The output row of ``<|im_end|>`` is 1.01 times that of the token greedy decoding picks ninth
    after :data:`PROMPT_TEXT`, so a greedy response reaches ``<|im_end|>`` after eight other
    tokens (:data:`TOKENS_BEFORE_END`).
    """
    path = Path(path)
    tokenizer = build_char_tokenizer()
    tokenizer.eos_token = END_OF_TEXT
    end_of_text, end_of_turn = tokenizer.convert_tokens_to_ids([END_OF_TEXT, END_OF_TURN])
    model = build_tiny_model(
        TinyModelConfig(), len(tokenizer), tokenizer.pad_token_id, tokenizer.bos_token_id, end_of_text
    )
    prompt = torch.tensor([tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)])
    with torch.no_grad():
        greedy = model.generate(
            prompt,
            max_new_tokens=TOKENS_BEFORE_END + 1,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tokenizer.pad_token_id,
        )
        head = model.get_output_embeddings().weight
        head[end_of_turn] = 1.01 * head[int(greedy[0, -1])]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = [end_of_text, end_of_turn]
    model.generation_config._from_model_config = False  # as a checkpoint's own file reads
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
