"""The SFT, DPO and reward-model configs refuse an engine mesh their workers cannot hold, naming
the key as the user wrote it (``engine.ep_size``), before any worker starts (issue 52): each
refusal is the engine's own :meth:`ParallelDims.check` message for the same degrees (the
reference), with the trainer's workers named where the engine names its world size. The RL
config's sections (``actor.engine``, ``critic.engine``, ``teacher.engine``) are
``tests/rl/test_config.py``'s."""

from __future__ import annotations

import re

import pytest

from tandem.config.overrides import config_from_overrides
from tandem.dpo.config import DPOConfig
from tandem.engine.parallel_dims import ParallelDims
from tandem.rm.config import RewardModelConfig
from tandem.sft.config import SFTConfig

REQUIRED = ("model_path=m", "data.train_path=t.jsonl", "trainer.global_batch_size=8")
SCHEMAS = {"sft": SFTConfig, "dpo": DPOConfig, "rm": RewardModelConfig}
MESHES = {  # (workers, sp, tp, ep) -> the key the refusal names
    "ep does not divide the workers": ((4, 1, 1, 3), "engine.ep_size=3"),
    "ep does not divide one tensor-parallel slice": ((4, 1, 2, 4), "engine.ep_size=4"),
    "sp does not divide the workers": ((4, 3, 1, 1), "engine.sp_size=3"),
}


def _engine_message(workers: int, sp: int, tp: int, ep: int) -> str:
    """What the engine's own check says of these degrees over ``workers`` (the reference)."""
    with pytest.raises(ValueError) as raised:
        ParallelDims(workers, sp, tp, ep).check("engine", world=f"the {workers} workers", unit="workers")
    return str(raised.value)


@pytest.mark.parametrize("trainer", list(SCHEMAS))
@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_mesh_the_workers_cannot_hold_is_refused_naming_the_key(trainer, mesh):
    (workers, sp, tp, ep), key = MESHES[mesh]
    overrides = [
        *REQUIRED,
        f"trainer.n_workers={workers}",
        "engine.strategy=fsdp2",
        f"engine.sp_size={sp}",
        f"engine.tp_size={tp}",
        f"engine.ep_size={ep}",
    ]
    expected = _engine_message(workers, sp, tp, ep)
    assert expected.startswith(key)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        config_from_overrides(SCHEMAS[trainer], overrides)


@pytest.mark.parametrize("trainer", list(SCHEMAS))
def test_a_mesh_the_workers_hold_is_taken(trainer):
    """Two workers holding one expert-parallel group of two (the same overrides, a mesh that fits)."""
    overrides = [*REQUIRED, "trainer.n_workers=2", "engine.strategy=fsdp2", "engine.ep_size=2"]
    assert config_from_overrides(SCHEMAS[trainer], overrides).engine.ep_size == 2
