"""What an RL checkpoint holds beside the engines' own state, and how a run resumes from one.

The controller's state (step, sampler position, adaptive KL coefficient, Python's random state)
goes into the checkpoint's state file; the actor's workers (and the critic's, when the run has one)
save their engines under ``actor/`` (and ``critic/``). :class:`tandem.run.checkpoints.CheckpointManager`
writes, checks and finds them."""

from __future__ import annotations

import ast
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.run.checkpoints import CheckpointManager
from tandem.run.sampler import EpochSampler


def trainer_state(step: int, sampler: EpochSampler, kl_controller: Any) -> dict[str, Any]:
    """The controller's part of a checkpoint after step ``step``."""
    return {
        "step": step,
        "sampler": sampler.state(),
        "kl_coef": kl_controller.value,
        "python_random": repr(random.getstate()),
    }


def save_engines(directory: Path, workers: Any, critics: Any | None) -> None:
    """The actor's engines into ``directory/actor``, the critic's (if any) into ``directory/critic``."""
    workers.save_checkpoint(str(directory / "actor"))
    if critics is not None:
        critics.save_checkpoint(str(directory / "critic"))


def resume_path(mode: str, checkpoints: CheckpointManager, warn: Callable[[str], None]) -> Path | None:
    """The checkpoint ``trainer.resume`` names: none (``disable``), the latest intact one (``auto``,
    ``warn`` told of each damaged one skipped), or the given directory, checked intact."""
    if mode == "disable":
        return None
    return (  # workers may run elsewhere: an absolute path
        checkpoints.resume_point(warn)
        if mode == "auto"
        else CheckpointManager.check_intact(Path(mode).absolute())
    )


def load_checkpoint(
    path: Path, workers: Any, critics: Any | None, sampler: EpochSampler, kl_controller: Any
) -> int:
    """Load the checkpoint at ``path`` into the engines, the sampler and the KL controller; returns
    its step. A run with a critic refuses a checkpoint saved without one."""
    state = CheckpointManager.read_state(path)
    workers.load_checkpoint(str(path / "actor"), state["step"])
    if critics is not None:
        if not (path / "critic").exists():
            raise ValueError(f"{path} holds no critic state; it was saved by a run without a critic")
        critics.load_checkpoint(str(path / "critic"))
    sampler.load_state(state["sampler"])
    kl_controller.value = state["kl_coef"]
    restore_python_random(state)
    return state["step"]


def restore_python_random(state: dict[str, Any]) -> None:
    """Python's random state as :func:`trainer_state` saved it (user code on the controller, such
    as a reward function drawing from ``random``, then continues its stream as if uninterrupted);
    a checkpoint without it leaves the state alone."""
    if "python_random" in state:
        random.setstate(ast.literal_eval(state["python_random"]))
