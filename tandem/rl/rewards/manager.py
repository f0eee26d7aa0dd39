"""``RewardManager``: score decoded responses by ``data_source``, in parallel, never failing the run.

Each response is scored by the user's function (``reward.custom_path``) or the built-in scorer
registered for its ``data_source``. A scorer that raises, runs past ``reward.timeout_s`` or
returns something other than a finite real number (:mod:`.values`) scores 0 and is counted
(``reward/errors``, ``reward/timeouts``), with a message naming the item. A dict result's
extra fields that are not numbers are left out of the metrics and counted
(``reward/invalid_fields``). DAPO's overlong penalty is added on top when enabled. Named
reward components (GDPO) come back as a ``[B, K]`` tensor (:mod:`.components`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from tandem.config.user_values import describe, real_number
from tandem.rl.config import OverlongPenaltyConfig, RewardConfig
from tandem.rl.rewards.components import reward_components
from tandem.rl.rewards.custom import load_reward_function
from tandem.rl.rewards.parallel import CallResult, run_with_timeouts
from tandem.rl.rewards.scorers import SCORERS


@dataclass
class RewardResult:
    """``scores [B]`` (after any overlong penalty), ``accuracy [B]`` (the scorer's ``acc``, else its
    score), metrics, ``components [B, K]``: the requested fields of each dict result, in the
    order asked for (None when none were asked for; see :mod:`.components`), and ``raw_scores [B]``
    (the scorer's scores before any overlong penalty)."""

    scores: torch.Tensor
    accuracy: torch.Tensor
    metrics: dict[str, float]
    errors: list[str] = field(default_factory=list)
    notes: list[str] = field(
        default_factory=list
    )  # dict fields left out (not numbers); the items still count
    components: torch.Tensor | None = None
    raw_scores: torch.Tensor | None = None


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
        component_keys: Sequence[str] = (),
        apply_overlong: bool = True,
    ) -> RewardResult:
        """Score each response; ``response_lengths [B]`` feeds the overlong penalty (left to the
        caller with ``apply_overlong=False``). ``component_keys`` names dict fields every result
        must carry, returned as ``components [B, K]``."""
        items = list(zip(data_sources, solutions, ground_truths, extra_infos, strict=True))
        results = run_with_timeouts(self._score_one, items, self.config.num_workers, self.config.timeout_s)
        components = reward_components(results, component_keys, data_sources) if component_keys else None
        values, accuracies, extras, errors, notes = _unpack(results, data_sources)
        scores = raw_scores = torch.tensor(values, dtype=torch.float32)
        accuracy = torch.tensor(accuracies, dtype=torch.float32)
        metrics = {
            "reward/errors": float(len(errors)),
            "reward/timeouts": float(sum(r.timeout for r in results)),
            "reward/invalid_fields": float(len(notes)),
        }
        if apply_overlong and self.config.overlong.enable:
            penalty = overlong_penalty(response_lengths, max_response_length, self.config.overlong)
            scores = scores + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        for name, column in extras.items():
            metrics[f"reward/extra/{name}/mean"] = sum(column) / len(column)
        return RewardResult(scores, accuracy, metrics, errors, notes, components, raw_scores)


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong: OverlongPenaltyConfig
) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[B]`` (<= 0) of responses of ``response_lengths [B]``."""
    expected = max_response_length - overlong.buffer
    excess = (response_lengths.float() - expected).clamp(min=0)
    return -(excess / overlong.buffer).clamp(max=1.0) * overlong.penalty_factor


def _unpack(
    results: list[CallResult], data_sources: Sequence[str]
) -> tuple[list[float], list[float], dict[str, list[float]], list[str], list[str]]:
    """Scores and accuracies (0 for failures; ``acc`` defaults to the score), the numeric extra
    fields of dict results, error messages (items scored 0) and notes on fields left out."""
    values: list[float] = []
    accuracies: list[float] = []
    extras: dict[str, list[float]] = defaultdict(list)
    errors: list[str] = []
    notes: list[str] = []
    for index, (result, source) in enumerate(zip(results, data_sources, strict=True)):
        where = f"item {index} ({source})"
        value, error, accuracy = result.value, result.error, None
        if error is None and isinstance(value, dict):
            if "score" not in value:
                error = f"returned a dict without 'score' (keys {sorted(map(str, value))[:6]})"
            for key, item in value.items():
                if key in ("score", "acc"):
                    continue
                number = real_number(item)
                if number is None:
                    notes.append(f"{where}: field {key!r} is {describe(item)}, not a finite number; left out")
                else:
                    extras[str(key)].append(number)
            if "acc" in value:
                accuracy = real_number(value["acc"])
                if accuracy is None:
                    notes.append(f"{where}: field 'acc' is {describe(value['acc'])}; the score stands in")
            value = value.get("score")
        score = real_number(value) if error is None else None
        if error is None and score is None:
            error = f"returned {describe(value)}, not a finite real number"
        if error is not None:
            errors.append(f"{where}: {error}")
            values.append(0.0)
            accuracies.append(0.0)
        else:
            values.append(score)
            accuracies.append(score if accuracy is None else accuracy)
    return values, accuracies, dict(extras), errors, notes
