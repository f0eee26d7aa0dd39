"""Run a verl command line on tandem: verl's keys translated to tandem's typed config.

``tandem train --verl KEY=VALUE ...`` (or ``python -m tandem.verl.main_ppo KEY=VALUE ...``,
verl's ``python -m verl.trainer.main_ppo`` with one word changed). The key table is
:mod:`tandem.verl.keys`; verl's names for estimators, losses and KL types are in
:mod:`tandem.verl.names`; docs/migrating-from-verl.md explains the rest.
"""

from tandem.verl.translate import Translation, translate

__all__ = ["Translation", "translate"]
