"""Models and tokenizers: local HF loading, tiny builders, fp32 chunked log-probabilities."""

from tandem.models.loading import check_vocab_compatible, load_model, load_tokenizer, resolve_dtype
from tandem.models.logprobs import log_probs_from_hidden, log_probs_from_logits
from tandem.models.tiny import TinyModelConfig, build_tiny_model, save_tiny_model
from tandem.models.tokenizer import build_char_tokenizer

__all__ = [
    "TinyModelConfig",
    "build_char_tokenizer",
    "build_tiny_model",
    "check_vocab_compatible",
    "load_model",
    "load_tokenizer",
    "log_probs_from_hidden",
    "log_probs_from_logits",
    "resolve_dtype",
    "save_tiny_model",
]
