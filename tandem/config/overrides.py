"""Typed configs from ``key=value`` overrides (Hydra-style dot paths) via OmegaConf structured configs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tandem.config.finite import check_finite_floats
from tandem.config.keys import check_override_keys

T = TypeVar("T")


def config_from_overrides(schema: type[T], overrides: Sequence[str], yaml_path: str | None = None) -> T:
    """Build ``schema`` (a dataclass) from its defaults, an optional YAML file of overrides, then ``overrides``.

    Unknown keys, wrong types and non-finite floats (:mod:`tandem.config.finite`) are errors
    naming the key; each dataclass's ``__post_init__`` validation runs on the result.
    """
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. trainer.total_steps=100)")
    check_override_keys(schema, overrides)
    overrides = [item.lstrip("+") for item in overrides]  # adding a key the schema has is setting it
    try:
        merged = OmegaConf.structured(schema)
        make_writable(merged)  # frozen dataclasses come back read-only; overrides must apply
        if yaml_path:
            merged = OmegaConf.merge(merged, OmegaConf.load(yaml_path))
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        check_finite_floats(schema, merged)  # NaN/inf named by the key as written, before any __post_init__
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ValueError(f"bad configuration: {error}") from None


def make_writable(node: DictConfig) -> None:
    """Clear the read-only flag on ``node`` and every nested config (frozen dataclasses set it)."""
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            make_writable(child)
