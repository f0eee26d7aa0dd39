"""Typed configs from ``key=value`` overrides (Hydra-style dot paths) via OmegaConf structured configs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tandem.config.build import build_config
from tandem.config.finite import check_finite_floats
from tandem.config.keys import check_override_keys
from tandem.config.plugins import load_plugins

T = TypeVar("T")


def config_from_overrides(
    schema: type[T], overrides: Sequence[str], yaml_path: str | None = None, plugins: Sequence[str] = ()
) -> T:
    """Build ``schema`` (a dataclass) from its defaults, an optional YAML file of overrides, then ``overrides``.

    Unknown keys, wrong types and non-finite floats (:mod:`tandem.config.finite`) are errors
    naming the key; the plugins (``plugins``, and ``--plugin``'s files) are imported next
    (:func:`load_node_plugins`), then each dataclass's ``__post_init__`` validation runs, its
    errors naming the keys as the user wrote them (:mod:`tandem.config.build`).
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
        load_node_plugins(merged, plugins)
        return build_config(merged)  # a reused config's errors name the path it was given at
    except OmegaConfBaseException as error:
        raise ValueError(f"bad configuration: {error}") from None


def load_node_plugins(node: DictConfig, command_line: Sequence[str] = ()) -> None:
    """Import the plugin files of ``command_line`` (``--plugin``'s) and of ``node.plugins``, before
    the config validates, so the names they register validate; ``node.plugins`` then lists both
    (the command line's first). A config without a ``plugins`` key is left alone."""
    if "plugins" not in node:
        return
    own = [str(path) for path in node.plugins]
    load_plugins(command_line, "--plugin")
    load_plugins(own, "plugins")
    node.plugins = [*command_line, *(path for path in own if path not in command_line)]


def make_writable(node: DictConfig) -> None:
    """Clear the read-only flag on ``node`` and every nested config (frozen dataclasses set it)."""
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            make_writable(child)
