"""File-system paths in a run's config, made absolute where the run starts.

Workers may not share the driver's working directory: on a Ray cluster started beforehand
(``ray start``), actors run in a directory of Ray's choosing, and a relative
``trainer.output_dir`` would scatter a checkpoint between the driver's folder and theirs. The
trainers therefore resolve their path keys against their own working directory before any
worker starts. Inputs (models, data, user code) are resolved only when they exist there, since a
``model_path`` may also name a model on the Hugging Face Hub.

Every trainer rank writes its part of a checkpoint under ``trainer.output_dir``, so on several
machines that directory must be one filesystem they all mount:
:func:`check_workers_share_output_dir` says so before any model loads.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

def _absolute(path: str, must_exist: bool) -> str:
    if not path or os.path.isabs(path) or (must_exist and not os.path.exists(path)):
        return path
    return os.path.abspath(path)


def _replace_key(config: T, key: str, update) -> T:
    """``config`` with the dotted ``key`` set to ``update(its value)`` (frozen dataclasses; a
    key this config does not have is left alone)."""
    head, _, rest = key.partition(".")
    if not hasattr(config, head):
        return config
    value: Any = getattr(config, head)
    new = _replace_key(value, rest, update) if rest else update(value)
    return dataclasses.replace(config, **{head: new}) if new is not value else config


def with_absolute_paths(config: T, outputs: tuple[str, ...], inputs: tuple[str, ...]) -> T:
    """``config`` with its relative path keys made absolute against this process's working
    directory: every key of ``outputs``, and those of ``inputs`` that exist here."""
    for key in outputs:
        config = _replace_key(config, key, lambda path: _absolute(path, must_exist=False))
    for key in inputs:
        config = _replace_key(config, key, lambda path: _absolute(path, must_exist=True))
    return config


def check_workers_share_output_dir(workers: Any, output_dir: Path) -> None:
    """Raise ``ValueError`` naming ``trainer.output_dir`` when a rank of ``workers`` cannot read a
    file this process writes in ``output_dir`` (a machine that does not mount it)."""
    seen = workers.ranks_seeing(str(output_dir))
    blind = [rank for rank in range(workers.world_size) if rank not in seen]
    if blind:
        raise ValueError(
            f"trainer.output_dir={output_dir}: worker rank {blind[0]} cannot read files written there "
            "(another machine without this filesystem); every rank writes its checkpoint part into it, "
            "so name a directory on a filesystem all the machines share"
        )
