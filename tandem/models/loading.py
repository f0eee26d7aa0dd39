"""Loading any HF decoder-only causal LM and its tokenizer from a local directory."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from tandem.models.gguf import resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` -> torch dtype, with an error listing the choices."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``path``; a pad token is set to EOS when the tokenizer has none.

    A directory whose ``tokenizer_config.json`` declares a generic ``tokenizer.json``-backed
    class is loaded as exactly that: ``AutoTokenizer`` would otherwise pick the model
    family's own class from ``config.json`` (e.g. ``Qwen2Tokenizer``), which replaces the
    saved pre-tokenizer and adds tokens. A GGUF ``path`` reads its converted directory.
    """
    path = resolve_model_path(str(path))
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"no tokenizer at {path}: not a directory (expected a save_pretrained directory)"
        )
    config_file = Path(path) / "tokenizer_config.json"
    declared = json.loads(config_file.read_text()).get("tokenizer_class") if config_file.exists() else None
    if declared in GENERIC_TOKENIZER_CLASSES:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """The causal LM saved in ``path``, in ``dtype``, with the given attention implementation: a
    vision-language model (a config with a ``vision_config``, such as Qwen2-VL's) loads as an
    image-text-to-text model, whose ``get_decoder()`` is its language model. A GGUF ``path``
    reads its converted directory (:func:`tandem.models.gguf.resolve_model_path`)."""
    path = Path(resolve_model_path(str(path)))
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no model at {path}: config.json is missing (expected a save_pretrained directory)"
        )
    vision = getattr(AutoConfig.from_pretrained(str(path)), "vision_config", None) is not None
    auto_class = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return auto_class.from_pretrained(
        str(path), dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
    )


def load_value_model(
    path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """The model in ``path`` as a one-output token classifier (a critic): its decoder, and its
    ``score`` head, freshly initialised when ``path`` holds a causal LM."""
    return _with_scalar_head(AutoModelForTokenClassification, path, dtype, attn_implementation)


def load_reward_model(
    path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa"
) -> PreTrainedModel:
    """The model in ``path`` as a one-output sequence classifier (a reward model): its decoder,
    and its ``score`` head, freshly initialised when ``path`` holds a causal LM. The config
    gets the tokenizer's pad id when it has none (HF finds each row's last token by it)."""
    model = _with_scalar_head(AutoModelForSequenceClassification, path, dtype, attn_implementation)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(path).pad_token_id
    return model


def _with_scalar_head(
    auto_class: type, path: str | Path, dtype: str, attn_implementation: str
) -> PreTrainedModel:
    """``auto_class`` (a classifier) with one label from ``path``; a causal LM gets a fresh head."""
    path = Path(resolve_model_path(str(path)))
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"no model at {path}: config.json is missing (expected a save_pretrained directory)"
        )
    previous = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized: score.weight" is the point here
    try:
        return auto_class.from_pretrained(
            str(path), num_labels=1, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation
        )
    finally:
        hf_logging.set_verbosity(previous)


def load_head_model(path: str | Path, head: str, dtype: str = "float32") -> PreTrainedModel:
    """The model an engine with ``engine.head=head`` trains: a causal LM (``lm``), a token
    classifier (``value``) or a sequence classifier (``reward``)."""
    loaders = {"lm": load_model, "value": load_value_model, "reward": load_reward_model}
    return loaders[head](path, dtype)


def check_vocab_compatible(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise when the tokenizer can emit ids the model's embedding table does not have."""
    check_vocab_fits(model.get_input_embeddings().weight.shape[0], tokenizer)


def check_vocab_fits(embedding_rows: int, tokenizer: PreTrainedTokenizerBase) -> None:
    """Raise when the tokenizer can emit ids an embedding table of ``embedding_rows`` does not have."""
    largest_id = max(len(tokenizer), max(tokenizer.all_special_ids, default=0) + 1)
    if largest_id > embedding_rows:
        raise ValueError(
            f"tokenizer/model vocab mismatch: the tokenizer has {largest_id} ids but the model's embedding has "
            f"{embedding_rows} rows; load the tokenizer that was saved with this model"
        )
