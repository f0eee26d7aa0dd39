"""``load_train_config``: Hydra composition of a preset and ``key=value`` overrides into a :class:`TrainConfig`.

The typed :class:`TrainConfig` is registered in Hydra's ConfigStore as ``train_schema``; each
preset in ``tandem/rl/presets/`` is a YAML file that starts from it (``defaults: [train_schema,
_self_]``) and sets the algorithm's knobs. Overrides use Hydra's grammar and are checked against
the schema (an unknown key or a wrong type names the key), every float is checked finite by its
full key (:mod:`tandem.config.finite`), the plugins are imported (:mod:`tandem.config.plugins`);
then every dataclass validates, a reused one's errors naming the key as written
(``actor.engine.lr``, not ``engine.lr``: :mod:`tandem.config.build`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from tandem.config.build import build_config
from tandem.config.finite import check_finite_floats
from tandem.config.keys import check_override_keys
from tandem.config.overrides import load_node_plugins, make_writable
from tandem.rl.config import TrainConfig

PRESET_DIR = Path(__file__).parent / "presets"
SCHEMA_NAME = "train_schema"


def presets() -> list[str]:
    """Names of the shipped presets (``preset=<name>``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _writable_schema() -> DictConfig:
    node = OmegaConf.structured(TrainConfig)
    make_writable(node)  # frozen dataclasses come back read-only; Hydra must be able to merge into them
    return node


def _store_schema() -> None:
    """Register the schema in Hydra's ConfigStore, once per process (building it takes a quarter of
    a config load; Hydra copies the stored node for each composition, so it is never changed)."""
    store = ConfigStore.instance()
    if f"{SCHEMA_NAME}.yaml" not in store.list(""):
        store.store(name=SCHEMA_NAME, node=_writable_schema())


def load_train_config(
    overrides: Sequence[str] = (), preset: str = "grpo", plugins: Sequence[str] = ()
) -> TrainConfig:
    """Compose ``preset`` with ``overrides`` (a ``preset=<name>`` item among them selects the preset);
    the plugin files of ``plugins`` (``--plugin``'s) and of the ``plugins`` key are imported before
    the config validates (:func:`~tandem.config.overrides.load_node_plugins`)."""
    rest = []
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key=value (e.g. rollout.n=8)")
        key, _, value = item.partition("=")
        if key == "preset":
            preset = value
        else:
            rest.append(item)
    if preset not in presets():
        raise ValueError(f"preset={preset!r} is not a preset; choose one of {presets()}")
    check_override_keys(TrainConfig, rest)
    _store_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(PRESET_DIR), version_base=None):
            composed = compose(config_name=preset, overrides=rest)
        check_finite_floats(TrainConfig, composed)  # NaN/inf named by the key as written, before any load
        load_node_plugins(composed, plugins)  # their names validate like built-in ones
        return build_config(composed)  # a reused config's errors name the path it was given at
    except (HydraException, OmegaConfBaseException) as error:
        cause = f" ({error.__cause__})" if error.__cause__ else ""
        raise ValueError(f"bad configuration: {error}{cause}") from None
    finally:
        GlobalHydra.instance().clear()
