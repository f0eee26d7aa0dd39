"""``rollout.*``: how responses are sampled, and by which engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.config.validation import check_positive, check_range
from tandem.protocol.generation import SamplingParams
from tandem.rollout.config import RolloutEngineConfig

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class RolloutConfig:
    """Generation (``rollout.*``): what to sample, and which engine samples it.

    Attributes:
        n: responses per prompt.
        temperature / top_p / top_k: sampling (the trainer's log-probs use the same temperature).
        max_response_length: most new tokens per response.
        engine: the rollout engine (``rollout.engine.name=native|vllm|hf``) and each engine's
            own settings (``rollout.engine.native.max_num_seqs``, ...). Its longest sequence,
            seed and device follow the data, ``trainer.seed`` and ``trainer.device``.
        val_temperature / val_n: validation sampling (temperature 0: greedy, so ``val_n`` is 1).
        val_top_p / val_top_k: validation's truncation (None: the same as training's).
        free_cache_between_generations: free the KV cache after each generation and allocate it
            again before the next, so the actor's update has that memory (colocated training on
            a memory-bound accelerator); off by default, since re-allocation costs time on CPU.
    """

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_response_length: int = 256
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    val_temperature: float = 0.0
    val_n: int = 1
    val_top_p: float | None = None
    val_top_k: int | None = None
    free_cache_between_generations: bool = False

    def __post_init__(self) -> None:
        check_positive("rollout", "n", self.n)
        check_positive("rollout", "temperature", self.temperature)
        check_range("rollout", "top_p", self.top_p, 0.0, 1.0, low_inclusive=False)
        check_range("rollout", "top_k", self.top_k, low=0)
        check_positive("rollout", "max_response_length", self.max_response_length)
        check_range("rollout", "val_temperature", self.val_temperature, low=0.0)
        check_positive("rollout", "val_n", self.val_n)
        if self.val_top_p is not None:
            check_range("rollout", "val_top_p", self.val_top_p, 0.0, 1.0, low_inclusive=False)
        if self.val_top_k is not None:
            check_range("rollout", "val_top_k", self.val_top_k, low=0)
        if self.val_temperature == 0.0 and self.val_n != 1:
            raise ValueError(
                f"rollout.val_n={self.val_n} needs rollout.val_temperature > 0 (greedy is deterministic)"
            )
        vllm_cannot_sleep = self.engine.name == "vllm" and not self.engine.vllm.enable_sleep_mode
        if self.free_cache_between_generations and vllm_cannot_sleep:
            raise ValueError(
                "rollout.free_cache_between_generations=true with rollout.engine.name=vllm needs "
                "rollout.engine.vllm.enable_sleep_mode=true (vLLM frees its cache only by sleeping)"
            )

    def sampling(self, temperature: float, validation: bool = False) -> SamplingParams:
        """How one response is sampled at ``temperature`` (0: greedy, so top-p/top-k are off);
        ``validation`` applies ``val_top_p`` / ``val_top_k`` where set."""
        greedy = temperature == 0.0
        top_p = self.val_top_p if validation and self.val_top_p is not None else self.top_p
        top_k = self.val_top_k if validation and self.val_top_k is not None else self.top_k
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0 if greedy else top_k,
            max_tokens=self.max_response_length,
        )
