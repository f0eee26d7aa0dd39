"""The token ids that end a generated sequence: the union of every source HF ``generate`` reads.

A checkpoint names its end-of-sequence ids in up to three places, and instruct checkpoints
often put their end-of-turn id in only one of them: ``config.json``'s ``eos_token_id`` (a
vision-language model's text config too), ``generation_config.json``'s ``eos_token_id`` (an
int or a list: Llama-3-Instruct's ``<|eot_id|>``, Qwen2.5's ``[<|im_end|>, <|endoftext|>]``),
and the tokenizer's ``eos_token``. Every rollout engine stops at all of them.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig, GenerationConfig, PretrainedConfig


def end_of_sequence_ids(source, tokenizer) -> frozenset[int]:
    """Every end-of-sequence id of a model: its config's, its generation config's and the tokenizer's.

    Args:
        source: an HF model (its ``config`` and, when it was loaded with ``from_pretrained``
            from a directory with a ``generation_config.json``, its ``generation_config``), or
            the path of a model directory (``config.json``, and ``generation_config.json``
            when there is one).
        tokenizer: its tokenizer (``eos_token_id`` may be None).
    """
    if isinstance(source, (str, Path)):
        config = AutoConfig.from_pretrained(str(source))
        generation = _saved_generation_config(Path(source))
    else:
        config = source.config
        generation = getattr(source, "generation_config", None)
    ids = [
        *_config_ids(config),
        *_as_list(getattr(generation, "eos_token_id", None)),
        tokenizer.eos_token_id,
    ]
    return frozenset(int(i) for i in ids if i is not None)


def _config_ids(config: PretrainedConfig) -> list:
    """``eos_token_id`` of ``config`` and of its text config (a vision-language model's language model)."""
    return [
        *_as_list(getattr(config, "eos_token_id", None)),
        *_as_list(config.get_text_config().eos_token_id),
    ]


def _saved_generation_config(path: Path) -> GenerationConfig | None:
    """``path``'s ``generation_config.json``, or None when the directory has none."""
    if not (path / "generation_config.json").exists():
        return None
    return GenerationConfig.from_pretrained(str(path))


def _as_list(value) -> list:
    """A token id, a list of them, or None, as a list."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]
