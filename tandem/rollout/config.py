"""``RolloutEngineConfig``: which rollout engine generates, and each engine's own settings.

``rollout.engine.name`` picks the engine; the fields of each engine live under its own name
(``rollout.engine.native.max_num_seqs``, ``rollout.engine.vllm.gpu_memory_utilization``,
``rollout.engine.hf.dtype``), declared once, in the engine's own config class. Fields that
follow from the rest of a run (the longest sequence, the seed, the device) are filled in by
the caller (:func:`tandem.rl.derived.rollout_engine_config` for the RL trainer), which
refuses a user value it would otherwise overwrite.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from tandem.config.validation import check_choice
from tandem.device import check_device_setting
from tandem.rollout.engines import ROLLOUT_ENGINES
from tandem.rollout.native_config import NativeEngineConfig
from tandem.rollout.vllm_engine import VLLMEngineConfig


@dataclass(frozen=True)
class HFEngineConfig:
    """The ``hf`` reference engine (transformers' ``generate``, one request at a time).

    Attributes:
        dtype: the model's dtype (the log-probs are computed in fp32 regardless).
        device: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
    """

    key_prefix: ClassVar[str] = "rollout.engine.hf"  # its messages' keys start so (tandem.config.build)

    dtype: str = "float32"
    device: str = "auto"

    def __post_init__(self) -> None:
        check_choice(self.key_prefix, "dtype", self.dtype, ["float32", "bfloat16", "float16"])
        check_device_setting(self.key_prefix, "device", self.device)


def _native_for_rl() -> NativeEngineConfig:
    # No prompt KV kept across steps: every weight update drops it, and copying each prompt's
    # keys/values into the cache costs time on every step (groups share a prompt within a step).
    return NativeEngineConfig(prefix_cache_entries=0)


@dataclass(frozen=True)
class RolloutEngineConfig:
    """The engine that generates (``rollout.engine.*``).

    Attributes:
        name: ``native`` (tandem's continuous-batching engine), ``vllm`` (needs ``pip install
            vllm``; vLLM's CPU build on a CPU machine) or ``hf`` (transformers' ``generate``,
            the slow reference).
        native / vllm / hf: each engine's own settings; only the chosen one is used.
    """

    name: str = "native"
    native: NativeEngineConfig = field(default_factory=_native_for_rl)
    vllm: VLLMEngineConfig = field(default_factory=VLLMEngineConfig)
    hf: HFEngineConfig = field(default_factory=HFEngineConfig)

    def __post_init__(self) -> None:
        check_choice("rollout.engine", "name", self.name, ROLLOUT_ENGINES)

    @property
    def selected(self) -> NativeEngineConfig | VLLMEngineConfig | HFEngineConfig:
        """The chosen engine's own config."""
        return getattr(self, self.name)

    @property
    def gpus_per_engine(self) -> int:
        """The GPUs one engine computes on: vLLM's ``tensor_parallel_size``, else one."""
        return self.vllm.tensor_parallel_size if self.name == "vllm" else 1

    def on_device(self, device: str) -> RolloutEngineConfig:
        """This config with every engine placed on ``device`` (a rank's bound device)."""
        return dataclasses.replace(
            self,
            native=dataclasses.replace(self.native, device=device),
            vllm=dataclasses.replace(self.vllm, device=device),
            hf=dataclasses.replace(self.hf, device=device),
        )
