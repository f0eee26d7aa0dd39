"""``RewardModelTrainer``: a Bradley–Terry reward model from preference pairs (``tandem rm``).

It is the DPO trainer (:mod:`tandem.dpo.trainer`) with a reward head: each response's score is
the head's output at its last token where DPO reads the response's summed log-prob, and the
loss is reference-free, so the data, packing (a pair's prompt computed once), workers,
checkpoints, resume, report and export are the same. ``rewards/chosen`` and
``rewards/rejected`` are the mean scores (times ``preference.beta``), ``rewards/accuracies`` the
share of pairs the model ranks right, ``rewards/margins`` the mean score gap; the ``eval_``
versions are the held-out pairs'. The model is exported as an HF
``...ForSequenceClassification`` directory (``hf_model/``) that the RL trainer's reward-model
role, TRL or vLLM can load.
"""

from __future__ import annotations

from tandem.dpo.trainer import DPOTrainer
from tandem.rm.config import RewardModelConfig

SCORE_DUPLICATES = (
    "logps/",
    "eval_logps/",
)  # a reward model's "log-probs" are its scores: rewards/* has them


class RewardModelTrainer(DPOTrainer):
    """Runs :class:`RewardModelConfig` end to end (see the module docstring)."""

    config: RewardModelConfig

    def describe(self) -> str:
        return f"reward model: {self.config.preference.name} loss on the scores (beta {self.config.preference.beta})"

    def train_step(self) -> dict[str, float]:
        return _without_duplicates(super().train_step())

    def evaluate_pairs(self) -> dict[str, float]:
        return _without_duplicates(super().evaluate_pairs())


def _without_duplicates(metrics: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in metrics.items() if not name.startswith(SCORE_DUPLICATES)}
