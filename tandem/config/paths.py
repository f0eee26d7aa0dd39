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


def _value(config: Any, key: str) -> Any:
    """The value at dotted ``key``, or None where this config has no such key."""
    for name in key.split("."):
        if not hasattr(config, name):
            return None
        config = getattr(config, name)
    return config


def _replace_keys(config: T, values: dict[str, Any]) -> T:
    """``config`` with each dotted key of ``values`` set, every dataclass on the way rebuilt once
    (so its checks see all the new values together: a key that must equal another stays equal)."""
    own: dict[str, Any] = {key: value for key, value in values.items() if "." not in key}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if "." in key:
            head, rest = key.split(".", 1)
            nested.setdefault(head, {})[rest] = value
    for head, below in nested.items():
        own[head] = _replace_keys(getattr(config, head), below)
    return dataclasses.replace(config, **own) if own else config


def with_absolute_paths(config: T, outputs: tuple[str, ...], inputs: tuple[str, ...]) -> T:
    """``config`` with its relative path keys made absolute against this process's working
    directory: every key of ``outputs``, and those of ``inputs`` that exist here (keys this
    config lacks are skipped)."""
    changed: dict[str, str] = {}
    for keys, must_exist in ((outputs, False), (inputs, True)):
        for key in keys:
            path = _value(config, key)
            if isinstance(path, str) and _absolute(path, must_exist) != path:
                changed[key] = _absolute(path, must_exist)
    return _replace_keys(config, changed) if changed else config


def check_workers_share_output_dir(workers: Any, output_dir: Path) -> None:
    """Raise ``ValueError`` naming ``trainer.output_dir`` when a rank of ``workers`` cannot read a
    file this process writes in ``output_dir`` (a machine that does not mount it); the
    directory is made if missing."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    seen = workers.ranks_seeing(str(output_dir))
    blind = [rank for rank in range(workers.world_size) if rank not in seen]
    if blind:
        raise ValueError(
            f"trainer.output_dir={output_dir}: worker rank {blind[0]} cannot read files written there "
            "(another machine without this filesystem); every rank writes its checkpoint part into it, "
            "so name a directory on a filesystem all the machines share"
        )
