"""``NativeEngineConfig``: the native rollout engine's sizes and limits (``rollout.engine.native.*``),
and the pause modes every engine accepts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tandem.config.validation import check_choice, check_positive, check_range
from tandem.device import check_device_setting

PAUSE_MODES = ("keep", "abort", "wait")
DEFAULT_MAX_NUM_SEQS = 256  # what an unset max_num_seqs asks for, before the KV cache's memory budget


@dataclass(frozen=True)
class NativeEngineConfig:
    """Sizes and limits of the native engine.

    Attributes:
        max_num_seqs: KV-cache slots = most requests running at once (admission waits beyond).
            Unset (``None``): 256, or as many as fit the KV cache's memory budget when fewer
            do (the engine says so). A value set that does not fit is an error.
        max_model_len: longest prompt + response in tokens; at most the model's
            ``max_position_embeddings`` (a model with rope scaling may go beyond, with a warning).
        kv_cache_memory_fraction: the KV cache may take this fraction of the memory available
            when the engine starts, after the model is loaded (free GPU memory; on the CPU
            ``MemAvailable`` capped by the cgroup's room), as vLLM's ``gpu_memory_utilization``
            bounds its cache.
        kv_cache_memory_bytes: a fixed KV-cache budget in bytes instead of the fraction (None:
            use the fraction).
        max_prefill_tokens: most prompt tokens admitted into one step.
        dtype: model and KV-cache dtype (the head is fp32 regardless).
        device: ``auto``, ``cpu``, ``cuda`` (this process's local-rank GPU) or ``cuda:N``.
        prefix_cache_entries: prompts whose KV stays cached for reuse (0: only within a step).
        seed: seeds the random streams of requests that bring no seed of their own.
        lean_forward: run Llama/Qwen2/Qwen3 models through :class:`LeanDecoder` (the same
            computation as HF's forward, bit for bit, without its per-layer Python overhead);
            other models always use HF's forward.
        prepack_weights: keep an inference copy of each fp32 linear weight in oneDNN's
            blocked layout (CPU): decode matmuls 1.3-1.8x faster for one more copy of those
            weights. Used by the lean forward and the output head.
        share_prefix_reads: when running requests share long prompts (the n samples of a
            GRPO prompt), decode attention may read each prompt's keys/values once per step
            instead of once per request (:mod:`tandem.rollout.shared_prefix`); the engine does
            so only where its measured rule says it pays (``worth_sharing``: >= 16 samples per
            prompt on average, prompts >= 48 tokens, and the prompt copies at least half of
            the decode's key/value reads), else it reads plainly.
        cuda_graphs: on CUDA, decode-only steps replay CUDA graphs, one per (batch, length)
            bucket, captured on first use (:mod:`tandem.rollout.decode_graphs`); needs the
            lean forward. Such steps read each prompt once per request (no shared reads).
    """

    key_prefix: ClassVar[str] = "rollout.engine.native"  # its messages' keys start so (tandem.config.build)

    max_num_seqs: int | None = None
    max_model_len: int = 2048
    kv_cache_memory_fraction: float = 0.5
    kv_cache_memory_bytes: int | None = None
    max_prefill_tokens: int = 8192
    dtype: str = "float32"
    device: str = "auto"
    prefix_cache_entries: int = 64
    seed: int = 0
    lean_forward: bool = True
    prepack_weights: bool = True
    share_prefix_reads: bool = True
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_prefill_tokens", "kv_cache_memory_bytes"):
            if getattr(self, name) is not None:
                check_positive(self.key_prefix, name, getattr(self, name))
        check_range(
            self.key_prefix,
            "kv_cache_memory_fraction",
            self.kv_cache_memory_fraction,
            0.0,
            1.0,
            low_inclusive=False,
        )
        check_choice(self.key_prefix, "dtype", self.dtype, ["float32", "bfloat16", "float16"])
        check_device_setting(self.key_prefix, "device", self.device)
