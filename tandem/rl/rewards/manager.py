"""``RewardManager``: score decoded responses by ``data_source``, in parallel, never failing the run.

Each response is scored by the user's function (``reward.custom_path``) or the built-in scorer
registered for its ``data_source``. A scorer that raises or runs past ``reward.timeout_s``
scores 0 and is counted (``reward/errors``, ``reward/timeouts``); the first few messages are
kept for the log. DAPO's overlong penalty is added on top when enabled.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.rl.config import RewardConfig
from tandem.rl.rewards.custom import load_reward_function
from tandem.rl.rewards.parallel import CallResult, run_with_timeouts
from tandem.rl.rewards.scorers import SCORERS


@dataclass
class RewardResult:
    """``scores [B]`` (after any overlong penalty), ``accuracy [B]`` (the scorer's ``acc``, else its score) and metrics."""

    scores: torch.Tensor
    accuracy: torch.Tensor
    metrics: dict[str, float]
    errors: list[str] = field(default_factory=list)


class RewardManager:
    """Scores a batch of responses; see the module docstring."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.custom: Callable | None = (
            load_reward_function(config.custom_path, config.custom_name) if config.custom_path else None
        )

    def _score_one(self, data_source: str, solution: str, ground_truth: str, extra_info: dict):
        if self.custom is not None:
            return self.custom(data_source, solution, ground_truth, extra_info)
        return SCORERS.get(data_source)(solution, ground_truth, extra_info)

    def check_sources(self, data_sources: Sequence[str]) -> None:
        """Fail before training when a data source has no scorer (and no custom function is set)."""
        if self.custom is None:
            for name in sorted(set(data_sources)):
                SCORERS.get(name)

    def score(
        self,
        data_sources: Sequence[str],
        solutions: Sequence[str],
        ground_truths: Sequence[str],
        extra_infos: Sequence[dict],
        response_lengths: torch.Tensor,
        max_response_length: int,
    ) -> RewardResult:
        """Score each response; ``response_lengths [B]`` feeds the overlong penalty."""
        items = list(zip(data_sources, solutions, ground_truths, extra_infos, strict=True))
        results = run_with_timeouts(self._score_one, items, self.config.num_workers, self.config.timeout_s)
        values, accuracies, extras, errors = _unpack(results)
        scores = torch.tensor(values, dtype=torch.float32)
        accuracy = torch.tensor(accuracies, dtype=torch.float32)
        metrics = {
            "reward/errors": float(len(errors)),
            "reward/timeouts": float(sum(r.timeout for r in results)),
        }
        overlong = self.config.overlong
        if overlong.enable:
            expected = max_response_length - overlong.buffer
            excess = (response_lengths.float() - expected).clamp(min=0)
            penalty = -(excess / overlong.buffer).clamp(max=1.0) * overlong.penalty_factor
            scores = scores + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        for name, column in extras.items():
            metrics[f"reward/extra/{name}/mean"] = sum(column) / len(column)
        return RewardResult(scores, accuracy, metrics, errors)


def _unpack(results: list[CallResult]) -> tuple[list[float], list[float], dict[str, list[float]], list[str]]:
    """Scores and accuracies (0 for failures; ``acc`` defaults to the score), the other numeric
    fields of dict results, and error messages."""
    values: list[float] = []
    accuracies: list[float] = []
    extras: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []
    for result in results:
        value, error = result.value, result.error
        accuracy = None
        if error is None and isinstance(value, dict):
            for key, item in value.items():
                if (
                    key not in ("score", "acc")
                    and isinstance(item, (int, float))
                    and not isinstance(item, bool)
                ):
                    extras[key].append(float(item))
            accuracy = value.get("acc")
            value = value.get("score")
        if error is None and not isinstance(value, (int, float, bool)):
            error = f"reward function returned {type(value).__name__}, not a number"
        if error is not None:
            errors.append(error)
            values.append(0.0)
            accuracies.append(0.0)
        else:
            values.append(float(value))
            accuracies.append(float(value if accuracy is None else accuracy))
    return values, accuracies, dict(extras), errors
