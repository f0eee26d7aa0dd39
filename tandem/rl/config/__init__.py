"""``TrainConfig``: everything ``tandem train`` reads, as typed dataclasses validated up front.

One module per concern, each with its fields and the checks that concern them: ``data``,
``actor`` (online DPO's checks too), ``rollout``, ``algorithm``, ``reward``, ``trainer``, the
asynchronous pipelines' checks (``pipeline``), ``train`` (the whole run: its sections,
placement) and ``rules`` (the rules that join sections: batch shapes, the parallel layout, the
head's precision; it runs every cross-section check, the derived engine settings' too). See :mod:`tandem.rl.config.train` for the batch-size
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
