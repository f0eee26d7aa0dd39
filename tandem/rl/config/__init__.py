"""``TrainConfig``: everything ``tandem train`` reads, as typed dataclasses validated up front.

One module per section, each with its fields and the checks of those fields alone: ``data``,
``actor``, ``rollout``, ``algorithm``, ``reward``, ``teacher``, ``trainer``, ``dataplane``;
``train`` (the whole run: its sections, placement) and ``rules`` (every rule that joins sections,
in the order they run: the parallel layout, batch shapes, the head's precision, the
asynchronous pipelines, online DPO, router replay, the critic, the teacher, then the data
plane's and the derived engine settings'). See :mod:`tandem.rl.config.train` for the batch-size
semantics.
"""

from tandem.rl.config.actor import OBJECTIVES, ActorConfig, ActorOffloadConfig
from tandem.rl.config.algorithm import AlgorithmConfig, FilterGroupsConfig
from tandem.rl.config.data import OVERLONG_PROMPTS, RLDataConfig, RLImageConfig
from tandem.rl.config.dataplane import RLDataPlaneConfig
from tandem.rl.config.reward import (
    INTERACTION_SOURCE,
    JUDGE_SOURCE,
    MODEL_SOURCE,
    REWARD_SOURCES,
    RULE_SOURCE,
    OverlongPenaltyConfig,
    RewardConfig,
    RewardModelSourceConfig,
)
from tandem.rl.config.rollout import RolloutConfig
from tandem.rl.config.train import TrainConfig
from tandem.rl.config.trainer import BACKENDS, LOGGERS, RESUME_MODES, TrainerConfig

__all__ = [
    "BACKENDS",
    "LOGGERS",
    "OBJECTIVES",
    "OVERLONG_PROMPTS",
    "INTERACTION_SOURCE",
    "JUDGE_SOURCE",
    "MODEL_SOURCE",
    "REWARD_SOURCES",
    "RULE_SOURCE",
    "RESUME_MODES",
    "ActorConfig",
    "ActorOffloadConfig",
    "AlgorithmConfig",
    "FilterGroupsConfig",
    "OverlongPenaltyConfig",
    "RLDataConfig",
    "RLDataPlaneConfig",
    "RLImageConfig",
    "RewardConfig",
    "RewardModelSourceConfig",
    "RolloutConfig",
    "TrainConfig",
    "TrainerConfig",
]
