"""How large the native engine's KV cache may be: its context within the model's positions, and
its sequences within a memory budget (a fraction of the memory available, as vLLM's
``gpu_memory_utilization`` bounds its cache).

The cache holds ``layers x 2 (keys, values) x kv_heads x head_dim`` elements per token, for
``max_num_seqs x max_model_len`` tokens, allocated whole when the engine starts. An unset
``max_num_seqs`` asks for :data:`~tandem.rollout.native_config.DEFAULT_MAX_NUM_SEQS` and takes
fewer when they do not fit; a value set that does not fit is refused, naming the keys, before
anything is allocated (the kernel would kill the process without a word).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch

from tandem.device import available_memory_bytes
from tandem.models.loading import resolve_dtype
from tandem.rollout.native_config import DEFAULT_MAX_NUM_SEQS, NativeEngineConfig

LOG = logging.getLogger(__name__)
GIB = 1 << 30
SEQS_KEY = "rollout.engine.native.max_num_seqs (tandem serve --max-num-seqs)"
LEN_KEY = "rollout.engine.native.max_model_len (tandem serve --max-model-len)"
BUDGET_KEYS = "rollout.engine.native.kv_cache_memory_fraction or kv_cache_memory_bytes"


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache the engine allocates: ``num_slots`` sequences of ``max_len`` tokens at
    ``bytes_per_token`` each (``layers x 2 x kv_heads x head_dim x dtype bytes``)."""

    num_slots: int
    max_len: int
    bytes_per_token: int
    budget: int | None  # bytes the cache may take (None: the system did not say)
    shrunk: bool  # fewer slots than the default asks for, to fit the budget

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.max_len * self.bytes_per_token

    def describe(self) -> str:
        """One line for the log: the figure, and how it was chosen."""
        budget = "no memory figure from the system" if self.budget is None else f"budget {size(self.budget)}"
        line = (
            f"native engine KV cache: {self.num_slots} sequences x {self.max_len} tokens = "
            f"{size(self.nbytes)} ({self.bytes_per_token} bytes per token; {budget})"
        )
        if self.shrunk:
            line += f"; max_num_seqs unset, so {self.num_slots} instead of {DEFAULT_MAX_NUM_SEQS} to fit"
        return line


def size(nbytes: int) -> str:
    """``nbytes`` for people: GiB with two decimals, MiB below one GiB."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / (1 << 20):.1f} MiB"


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one cached token takes across the model: ``layers x 2 x kv_heads x head_dim x dtype bytes``."""
    return num_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def memory_budget(config: NativeEngineConfig, device: torch.device) -> int | None:
    """Bytes the KV cache may take on ``device``: ``kv_cache_memory_bytes`` when set, else
    ``kv_cache_memory_fraction`` of the memory available now (None when the system does not say)."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    available = available_memory_bytes(device)
    return None if available is None else int(available * config.kv_cache_memory_fraction)


def plan_kv_cache(config: NativeEngineConfig, bytes_per_token: int, budget: int | None) -> KVCachePlan:
    """The slots to allocate under ``budget`` bytes; ``ValueError`` naming the keys when a set
    ``max_num_seqs``, or even one sequence of ``max_model_len`` tokens, does not fit."""
    asked = config.max_num_seqs or DEFAULT_MAX_NUM_SEQS
    per_sequence = config.max_model_len * bytes_per_token
    if budget is None or asked * per_sequence <= budget:
        return KVCachePlan(asked, config.max_model_len, bytes_per_token, budget, shrunk=False)
    need = f"{asked} sequences x {config.max_model_len} tokens x {bytes_per_token} bytes = {size(asked * per_sequence)}"
    have = f"the KV-cache budget is {size(budget)} ({BUDGET_KEYS})"
    fits = budget // per_sequence
    if config.max_num_seqs is not None:
        raise ValueError(
            f"the KV cache for max_num_seqs={asked} does not fit: {need}, and {have}; lower {SEQS_KEY} "
            f"(at most {fits} fit) or {LEN_KEY}"
        )
    if fits < 1:
        raise ValueError(
            f"not even one sequence's KV cache fits: {config.max_model_len} tokens x {bytes_per_token} bytes = "
            f"{size(per_sequence)}, and {have}; lower {LEN_KEY}"
        )
    return KVCachePlan(int(fits), config.max_model_len, bytes_per_token, budget, shrunk=True)


def check_positions(text_config, max_model_len: int) -> None:
    """Refuse a ``max_model_len`` beyond the model's ``max_position_embeddings`` (positions it
    was never trained on), naming both; a model whose rope scaling may extend its context
    (any rope type but ``default``) gets a warning instead."""
    positions = getattr(text_config, "max_position_embeddings", None)
    if positions is None or max_model_len <= positions:
        return
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    # one dict, or one per layer type (transformers 5: full_attention / sliding_attention)
    kinds = []
    if isinstance(rope, dict):
        kinds = [part for part in rope.values() if isinstance(part, dict)] or [rope]
    types = {kind.get("rope_type", kind.get("type", "default")) for kind in kinds}
    rope_type = next((t for t in sorted(types) if t != "default"), "default")
    message = f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={positions}"
    if rope_type != "default":
        warnings.warn(f"{message}; its {rope_type!r} rope scaling may extend it, so it is kept", stacklevel=3)
        return
    raise ValueError(f"{message}: lower {LEN_KEY} to at most {positions}")


def engine_kv_plan(
    config: NativeEngineConfig, text_config, head_dim: int, device: torch.device
) -> KVCachePlan:
    """The engine's KV cache for a model (its HF text config): context checked against its
    positions (:func:`check_positions`), slots planned under the memory budget, the figure logged."""
    check_positions(text_config, config.max_model_len)
    per_token = kv_bytes_per_token(
        text_config.num_hidden_layers, text_config.num_key_value_heads, head_dim, resolve_dtype(config.dtype)
    )
    plan = plan_kv_cache(config, per_token, memory_budget(config, device))
    LOG.info(plan.describe())
    return plan
