"""The table of verl keys tandem reads: each key, verl's default, and what it becomes.

Three kinds of key:

* **mapped** — the value becomes one or more tandem keys (``to``, converted by ``convert``);
  several keys that only make sense together (micro-batch sizes, clip ratios, the KL type,
  devices, ...) are ``joint``: :mod:`tandem.verl.joint` reads them as a group.
* **noted** — meaningless here (memory and speed knobs tandem decides itself, such as
  offloading or tensor parallelism): accepted, and the translation prints ``note``.
* **required value** — a feature tandem does not have: accepted only at the value that
  leaves it off (``only``); any other value is an error naming the key.

A verl key missing from the table is an error too. verl's defaults (``default``) are applied
for every mapped key the command leaves out, so a translated run starts from verl's
settings, not tandem's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.verl.keys_policy import POLICY_RULES
from tandem.verl.keys_rollout import ROLLOUT_RULES
from tandem.verl.keys_run import RUN_RULES
from tandem.verl.rules import ACTOR, ALGO, ARF, MISSING, MODEL, REF, ROLLOUT, Rule

__all__ = [
    "ACTOR",
    "ALGO",
    "ARF",
    "BY_KEY",
    "DEFAULTS",
    "MISSING",
    "MODEL",
    "REF",
    "ROLLOUT",
    "RULES",
    "Collected",
    "Rule",
]

RULES: tuple[Rule, ...] = POLICY_RULES + ROLLOUT_RULES + RUN_RULES

BY_KEY: dict[str, Rule] = {rule.key: rule for rule in RULES}
DEFAULTS: dict[str, Any] = {rule.key: rule.default for rule in RULES if rule.default is not MISSING}


@dataclass
class Collected:
    """A verl command's keys, split by kind. ``values`` holds verl's defaults overlaid with the command's."""

    values: dict[str, Any]
    given: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
