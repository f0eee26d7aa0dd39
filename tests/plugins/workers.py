"""A worker that resolves registry names while it is built (importable by spawned processes and Ray actors)."""

import os

import torch

from tandem.algos import ADVANTAGE_ESTIMATORS, AdvantageConfig, AdvantageInput
from tandem.config.plugins import plugin_of
from tandem.controller import Worker, register


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
