"""A worker that resolves registry names while it is built (importable by spawned processes and Ray actors)."""

import os

import torch

from tandem.agents.loops import AGENT_LOOPS
from tandem.algos import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES, AdvantageConfig, AdvantageInput
from tandem.algos.preference import PREFERENCE_LOSSES
from tandem.config.plugins import plugin_of
from tandem.controller import Worker, register
from tandem.rl.rewards import SCORERS
from tandem.rl.stages import STEP_STAGES

REGISTRIES = {  # the registries the example plugins add to, by a name for each
    "advantage_estimators": ADVANTAGE_ESTIMATORS,
    "policy_losses": POLICY_LOSSES,
    "kl_estimators": KL_ESTIMATORS,
    "preference_losses": PREFERENCE_LOSSES,
    "scorers": SCORERS,
    "agent_loops": AGENT_LOOPS,
    "step_stages": STEP_STAGES,
}


class EstimatorWorker(Worker):
    """Looks ``estimator`` up in its constructor: a plugin's name must be registered by then."""

    def __init__(self, estimator: str) -> None:
        self.estimator = ADVANTAGE_ESTIMATORS.get(estimator)
        self.config = AdvantageConfig(estimator=estimator)

    @register(dispatch="ONE_TO_ALL")
    def advantages(
        self, rewards: torch.Tensor, group_ids: torch.Tensor
    ) -> tuple[torch.Tensor, str | None, int]:
        """``rewards [B, R]``' advantages under the estimator, the file that defined it, and this process."""
        inputs = AdvantageInput(rewards, torch.ones_like(rewards), group_ids=group_ids)
        return self.estimator(inputs, self.config).advantages, plugin_of(self.estimator), os.getpid()

    @register(dispatch="ONE_TO_ALL")
    def defined_in(self, names: list[tuple[str, str]]) -> list[str | None]:
        """The plugin file that defined each ``(registry, name)`` as this process resolves it."""
        return [plugin_of(_entry(REGISTRIES[registry].get(name))) for registry, name in names]


def _entry(entry):
    """The function behind a registry entry (a step stage is a declaration holding it as ``run``)."""
    return getattr(entry, "run", entry)
