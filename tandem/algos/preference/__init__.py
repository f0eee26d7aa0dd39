"""Preference-optimization losses: DPO and its family, registered by name.

* :mod:`~tandem.algos.preference.base` — the pair input and output, ``PREFERENCE_LOSSES``,
  f-divergence scores, the NLL term
* :mod:`~tandem.algos.preference.paired` — losses against a reference (TRL's DPO loss types)
* :mod:`~tandem.algos.preference.reference_free` — SimPO, Bradley–Terry, CPO, AlphaPO, ORPO
* :mod:`~tandem.algos.preference.kto` — unpaired losses (KTO), ``UNPAIRED_LOSSES``
* :mod:`~tandem.algos.preference.config` — ``PreferenceLossConfig``
* :mod:`~tandem.algos.preference.combine` — several losses with weights, WPO, RPO
"""

from tandem.algos.preference import paired, reference_free  # noqa: F401  (they register the losses)
from tandem.algos.preference.base import (
    F_DIVERGENCE_LOSSES,
    PREFERENCE_LOSSES,
    REFERENCE_FREE,
    PreferenceInput,
    PreferenceOutput,
    f_divergence_score,
    register_preference_loss,
)
from tandem.algos.preference.combine import compute_preference_loss
from tandem.algos.preference.config import PreferenceLossConfig
from tandem.algos.preference.kto import (
    KL_BASELINE,
    UNPAIRED_LOSSES,
    UnpairedInput,
    UnpairedOutput,
    compute_unpaired_loss,
    kto_kl_estimate,
)

__all__ = [
    "F_DIVERGENCE_LOSSES",
    "KL_BASELINE",
    "PREFERENCE_LOSSES",
    "REFERENCE_FREE",
    "UNPAIRED_LOSSES",
    "PreferenceInput",
    "PreferenceLossConfig",
    "PreferenceOutput",
    "UnpairedInput",
    "UnpairedOutput",
    "compute_preference_loss",
    "compute_unpaired_loss",
    "f_divergence_score",
    "kto_kl_estimate",
    "register_preference_loss",
]
