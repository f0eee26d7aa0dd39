"""Typed configs from a merged OmegaConf node, each nested config's errors naming the key the user wrote.

A config class that several sections reuse names itself in its messages by one fixed prefix,
declared on the class: ``key_prefix: ClassVar[str] = "engine"`` (``EngineConfig``, whose
``__post_init__`` raises ``engine.lr=...``). :func:`build_config` knows the dotted path of every
config it constructs; a ``ValueError`` raised by the constructor of a config at path ``P`` gets
each key of its message that starts with the class's prefix renamed to start with ``P``
(``engine.lr`` -> ``actor.engine.lr``, ``engine.lora.rank`` -> ``critic.engine.lora.rank``), the
rest of the message unchanged. It happens once, where the error is raised: the configs around it
pass the error on as it is. A config built in Python (no loader) keeps the class's own prefix.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

KEY_PREFIX = "key_prefix"  # the class attribute a reused config class names itself by


def build_config(node: Any, path: str = "") -> Any:
    """``OmegaConf.to_object(node)``, built config by config so that errors name their path.

    Args:
        node: a merged OmegaConf node (a structured ``DictConfig`` at the root), or a plain value.
        path: the dotted key of ``node`` as the user writes it (``actor.engine``), ``""`` at the root.

    Returns the same objects ``OmegaConf.to_object`` returns: dataclass instances for structured
    nodes (their ``__post_init__`` run, innermost first), lists and dicts for the other containers.
    """
    if isinstance(node, ListConfig):
        return [build_config(node[index], f"{path}[{index}]") for index in range(len(node))]
    if not isinstance(node, DictConfig):
        return node
    schema = OmegaConf.get_type(node)
    values = {key: build_config(node[key], _child_path(path, key)) for key in node.keys()}
    if not dataclasses.is_dataclass(schema):
        return values
    init = {f.name for f in dataclasses.fields(schema) if f.init}
    try:
        result = schema(**{key: value for key, value in values.items() if key in init})
    except ValueError as error:
        _rename_keys(error, getattr(schema, KEY_PREFIX, ""), path)
        raise
    for key, value in values.items():
        if key not in init:
            setattr(result, key, value)  # as OmegaConf.to_object sets them
    return result


def key_by_path(message: str, prefix: str, path: str) -> str:
    """``message`` with each key that starts with ``prefix`` (``engine.lr``) starting with ``path``
    instead (``actor.engine.lr``); a key that already has more in front of it (``actor.engine.lr``,
    ``docs/engine.md``) is left alone, and so is ``prefix`` as a plain word."""
    if not prefix or not path or prefix == path:
        return message
    return re.sub(rf"(?<![\w./-]){re.escape(prefix)}(?=\.\w|=|\[)", lambda _: path, message)


def _rename_keys(error: ValueError, prefix: str, path: str) -> None:
    """Rename the keys of ``error``'s message in place (its type and traceback stay)."""
    if error.args and isinstance(error.args[0], str):
        error.args = (key_by_path(error.args[0], prefix, path), *error.args[1:])


def _child_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)
