"""The rollout engines by name: the one table that ``rollout.engine.name``, verl's
``rollout.name`` and ``tandem serve --engine`` read."""

from __future__ import annotations

from tandem.rollout.base import RolloutEngine
from tandem.rollout.hf_engine import HFRolloutEngine
from tandem.rollout.native import NativeRolloutEngine
from tandem.rollout.vllm_engine import VLLMRolloutEngine

ENGINE_CLASSES: dict[str, type[RolloutEngine]] = {
    "native": NativeRolloutEngine,
    "vllm": VLLMRolloutEngine,
    "hf": HFRolloutEngine,
}
ROLLOUT_ENGINES = tuple(ENGINE_CLASSES)
# The engines a server can stand behind: those whose requests run on a thread of their own
# (RolloutEngine.generates_in_background); ``hf`` generates inside submit(), one whole request at a time.
SERVING_ENGINES = tuple(name for name, engine in ENGINE_CLASSES.items() if engine.generates_in_background)
