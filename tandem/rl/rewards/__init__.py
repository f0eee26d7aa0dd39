"""Rewards: scorers registered by ``data_source``, user functions from a file, parallel scoring with timeouts."""

from tandem.rl.rewards.custom import load_reward_function
from tandem.rl.rewards.manager import RewardManager, RewardResult
from tandem.rl.rewards.parallel import CallResult, run_with_timeouts
from tandem.rl.rewards.scorers import SCORERS, register_scorer

__all__ = [
    "SCORERS",
    "CallResult",
    "RewardManager",
    "RewardResult",
    "load_reward_function",
    "register_scorer",
    "run_with_timeouts",
]
