"""File-system paths in a run's config, made absolute where the run starts.

Workers may not share the driver's working directory: on a Ray cluster started beforehand
(``ray start``), actors run in a directory of Ray's choosing, and a relative
``trainer.output_dir`` would scatter a checkpoint between the driver's folder and theirs. The
trainers therefore resolve their path keys against their own working directory before any
worker starts: every config field declared with :func:`path_field` (marked on the field, so a new
path key cannot be forgotten in a list elsewhere). Inputs (models, data, user code) are resolved
only when they exist there, since a ``model_path`` may also name a model on the Hugging Face Hub.
A model's path is marked :data:`MODEL_PATH` (an input, and the one kind a GGUF file is converted
for: :func:`model_path_keys` lists them).

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


INPUT_PATH = "input"  # read by the run: resolved only when it exists here (else a Hub id, left alone)
OUTPUT_PATH = "output"  # written by the run: always resolved
MODEL_PATH = "model"  # a model the run loads: an input, and a GGUF file there is converted once
PATH_KINDS = (INPUT_PATH, OUTPUT_PATH, MODEL_PATH)
_PATH_KIND = "path"  # the key of a dataclass field's metadata that marks it


def path_field(kind: str, default: str | tuple[str, ...] | None = "") -> Any:
    """A config dataclass field that holds a file-system path (or a tuple of them), marked so that
    :func:`with_absolute_paths` finds it: ``kind`` is :data:`INPUT_PATH`, :data:`OUTPUT_PATH` or
    :data:`MODEL_PATH`."""
    if kind not in PATH_KINDS:
        raise ValueError(f"a path field is one of {list(PATH_KINDS)}, not {kind!r}")
    return dataclasses.field(default=default, metadata={_PATH_KIND: kind})


def path_kind(field: dataclasses.Field) -> str | None:
    """The kind (one of :data:`PATH_KINDS`) of a field made by :func:`path_field`, else None."""
    return field.metadata.get(_PATH_KIND)


def _absolute(path: str, must_exist: bool) -> str:
    if not path or os.path.isabs(path) or (must_exist and not os.path.exists(path)):
        return path
    return os.path.abspath(path)


def _absolute_value(value: Any, must_exist: bool) -> Any:
    """A path, or each path of a list or tuple of them, made absolute (anything else as it is)."""
    if isinstance(value, str):
        return _absolute(value, must_exist)
    if isinstance(value, list | tuple) and all(isinstance(item, str) for item in value):
        return type(value)(_absolute(item, must_exist) for item in value)
    return value


def with_absolute_paths(config: T) -> T:
    """``config`` with every relative path in a field marked by :func:`path_field`, at any depth of
    nested config dataclasses, made absolute against this process's working directory: outputs
    always, inputs and models where they exist here. Each dataclass on the way is rebuilt once, with all its
    new values together, so its checks see them together (a key that must equal another stays
    equal when both resolve)."""
    changed: dict[str, Any] = {}
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        kind = path_kind(field)
        if kind is not None:
            resolved = _absolute_value(value, must_exist=kind != OUTPUT_PATH)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            resolved = with_absolute_paths(value)
        else:
            continue
        if resolved is not value and resolved != value:
            changed[field.name] = resolved
    return dataclasses.replace(config, **changed) if changed else config  # type: ignore[type-var]


def model_path_keys(config: Any, prefix: str = "") -> tuple[str, ...]:
    """The dotted keys of every field marked :data:`MODEL_PATH` in ``config``, at any depth of
    nested config dataclasses, in field order (``prefix`` starts each key)."""
    keys: list[str] = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if path_kind(field) == MODEL_PATH:
            keys.append(f"{prefix}{field.name}")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            keys += model_path_keys(value, f"{prefix}{field.name}.")
    return tuple(keys)


def _value(config: Any, key: str) -> Any:
    """The value at dotted ``key``, or None where this config has no such key."""
    for name in key.split("."):
        if not hasattr(config, name):
            return None
        config = getattr(config, name)
    return config


def replace_keys(config: T, values: dict[str, Any]) -> T:
    """``config`` with each dotted key of ``values`` set, every dataclass on the way rebuilt once
    (so its checks see all the new values together: a key that must equal another stays equal)."""
    own: dict[str, Any] = {key: value for key, value in values.items() if "." not in key}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        if "." in key:
            head, rest = key.split(".", 1)
            nested.setdefault(head, {})[rest] = value
    for head, below in nested.items():
        own[head] = replace_keys(getattr(config, head), below)
    return dataclasses.replace(config, **own) if own else config


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
