"""The example plugins (examples/plugins/), and registries put back as tandem left them after each test."""

import sys
from pathlib import Path

import pytest

from tandem.agents.loops import AGENT_LOOPS
from tandem.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
from tandem.algos.advantages import base as advantage_base
from tandem.algos.distill import DISTILL_ADVANTAGES, DISTILL_LOSSES
from tandem.algos.preference import F_DIVERGENCE_LOSSES, PREFERENCE_LOSSES, REFERENCE_FREE, UNPAIRED_LOSSES
from tandem.config import plugins
from tandem.rl.rewards import SCORERS
from tandem.rl.stages import STEP_STAGES
from tests.conftest import ROOT

EXAMPLES = Path(ROOT) / "examples" / "plugins"
REGISTRIES = [
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    KL_ESTIMATORS,
    PREFERENCE_LOSSES,
    UNPAIRED_LOSSES,
    DISTILL_ADVANTAGES,
    DISTILL_LOSSES,
    SCORERS,
    AGENT_LOOPS,
    STEP_STAGES,
]
SIDE_TABLES = [
    advantage_base._REQUIREMENTS,
    advantage_base._USES_IF_GIVEN,
    REFERENCE_FREE,
    F_DIVERGENCE_LOSSES,
]


def example(name: str) -> str:
    """The path of the example plugin ``examples/plugins/<name>.py``."""
    return str(EXAMPLES / f"{name}.py")


@pytest.fixture(autouse=True)
def tandem_registries_only():
    """Each test starts from tandem's own names and leaves them so (a plugin's names would
    otherwise stay registered for the rest of the session, and a file count as loaded)."""
    saved = [(registry, dict(registry._entries), dict(registry._aliases)) for registry in REGISTRIES]
    tables = [table.copy() for table in SIDE_TABLES]
    loaded = dict(plugins._LOADED)
    yield
    for registry, entries, aliases in saved:
        registry._entries = entries
        registry._aliases = aliases
    for table, copy in zip(SIDE_TABLES, tables, strict=True):
        table.clear()
        table.update(copy)
    for name in set(plugins._LOADED.values()) - set(loaded.values()):
        sys.modules.pop(name, None)
    plugins._LOADED.clear()
    plugins._LOADED.update(loaded)
