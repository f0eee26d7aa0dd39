"""``RewardSources``: every source in ``reward.sources`` scores each response; the weighted sum is the reward.

* ``rule``: the user's function or the built-in scorer of the row's ``data_source``
  (:class:`~tandem.rl.rewards.manager.RewardManager`); its ``acc`` stays the accuracy metric
  and its named fields the GDPO components.
* ``model``: a reward model in a worker group of its own
  (:class:`~tandem.rl.rewards.model_worker.RewardModelWorker`), reading the decoded prompt and
  response with its own tokenizer and chat template.
* ``judge``: an LLM behind an OpenAI-compatible endpoint (:class:`~tandem.rl.rewards.judge.LLMJudge`).
* ``interaction``: the reward the ``interaction`` agent loop's user function ended the episode
  with (``agent_reward``); an episode it did not end with one scores 0 for this source and
  counts in ``reward/interaction/missing``.

Each source is logged as ``reward/<source>/mean`` (when there is more than the rule alone);
failures of any source score 0 for that source and count in ``reward/errors``. DAPO's
overlong penalty applies to the combined score. With the default ``sources=[rule]`` the result
is exactly the rule's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.controller import WorkerGroup
from tandem.protocol import Batch
from tandem.rl.config import (
    INTERACTION_SOURCE,
    JUDGE_SOURCE,
    MODEL_SOURCE,
    RULE_SOURCE,
    RewardConfig,
)
from tandem.rl.rewards.judge import LLMJudge, prompt_text
from tandem.rl.rewards.manager import RewardManager, RewardResult, overlong_penalty


class RewardSources:
    """Scores a batch with the configured sources (see the module docstring).

    ``model_group`` is the reward-model workers' group (when ``model`` is a source), set by the
    trainer once it has started them.
    """

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.weights = config.source_weights
        self.rule = RewardManager(config) if RULE_SOURCE in self.weights else None
        self.model_group: WorkerGroup | None = None
        self.judge = LLMJudge(config.judge) if JUDGE_SOURCE in self.weights else None

    def check_sources(self, data_sources: Sequence[str]) -> None:
        """Fail before training when the rule source has no scorer for a data source."""
        if self.rule is not None:
            self.rule.check_sources(data_sources)

    def score(
        self,
        batch: Batch,
        texts: Sequence[str],
        response_lengths: torch.Tensor,
        max_response_length: int,
        component_keys: Sequence[str] = (),
    ) -> RewardResult:
        """The combined reward of each of ``texts`` (the decoded responses of ``batch``, which
        holds ``data_source``, ``ground_truth``, ``extra_info`` and ``raw_prompt``)."""
        parts: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {"reward/errors": 0.0}
        errors: list[str] = []
        rule = None
        if self.rule is not None:
            rule = self.rule.score(
                batch["data_source"], texts, batch["ground_truth"], batch["extra_info"],
                response_lengths, max_response_length, component_keys, apply_overlong=False,
            )  # fmt: skip
            parts[RULE_SOURCE] = rule.raw_scores
            metrics.update(rule.metrics)
            errors += rule.errors
        for name, source in (
            (MODEL_SOURCE, self._model_scores),
            (INTERACTION_SOURCE, self._interaction_scores),
            (JUDGE_SOURCE, self._judge_scores),
        ):
            if name in self.weights:
                parts[name], source_metrics, source_errors = source(batch, texts)
                metrics["reward/errors"] += source_metrics.pop("reward/errors", 0.0)
                metrics.update(source_metrics)
                errors += source_errors
        raw = sum(self.weights[name] * parts[name] for name in self.weights)
        assert isinstance(raw, torch.Tensor)
        if list(parts) != [RULE_SOURCE]:
            metrics.update({f"reward/{name}/mean": float(values.mean()) for name, values in parts.items()})
        scores = raw
        if self.config.overlong.enable:
            penalty = overlong_penalty(response_lengths, max_response_length, self.config.overlong)
            scores = raw + penalty
            metrics["reward/overlong_penalty_mean"] = float(penalty.mean())
        return RewardResult(
            scores,
            rule.accuracy if rule is not None else raw.clone(),
            metrics,
            errors,
            rule.notes if rule is not None else [],
            rule.components if rule is not None else None,
            raw,
        )

    def _model_scores(
        self, batch: Batch, texts: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """The reward model's score of each decoded prompt and response; one its tokenizer cannot
        encode scores 0, counted."""
        if self.model_group is None:
            raise RuntimeError(
                f"reward.sources has {MODEL_SOURCE!r}, but the reward-model workers are not running"
            )
        asked = Batch(non_tensors={"raw_prompt": list(batch["raw_prompt"]), "response_text": list(texts)})
        scored = self.model_group.score(asked)
        failed = scored["failed"].bool()
        metrics = {
            "reward/model/truncated": float(scored["truncated"].sum()),
            "reward/model/errors": float(failed.sum()),
            "reward/errors": float(failed.sum()),
        }
        errors = [
            f"item {row} ({texts[row][:40]!r}): the reward model's tokenizer cannot encode it; scored 0"
            for row in failed.nonzero().flatten().tolist()
        ]
        return scored["score"].float(), metrics, errors

    def _interaction_scores(
        self, batch: Batch, texts: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """The reward each episode's interaction ended it with; 0 (counted) where it ended otherwise."""
        given = list(batch["agent_reward"])
        scores = torch.tensor([0.0 if r is None else float(r) for r in given])
        return scores, {"reward/interaction/missing": float(sum(r is None for r in given))}, []

    def _judge_scores(
        self, batch: Batch, texts: Sequence[str]
    ) -> tuple[torch.Tensor, dict[str, float], list[str]]:
        """The LLM judge's grade of each response (0 for a failed request, counted)."""
        assert self.judge is not None
        prompts = [prompt_text(messages) for messages in batch["raw_prompt"]]
        judged = self.judge.score(prompts, texts, list(batch["ground_truth"]))
        metrics = {**judged.metrics(), "reward/errors": float(len(judged.errors))}
        return judged.scores, metrics, [f"judge {error}" for error in judged.errors]
