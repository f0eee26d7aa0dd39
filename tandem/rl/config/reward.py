"""``reward.*``: the reward sources (rules, user functions, reward models, LLM judges, interactions) and the overlong penalty."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config.paths import INPUT_PATH, MODEL_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.rl.judge_config import JudgeConfig


@dataclass(frozen=True)
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (``reward.overlong.*``): responses longer than
    ``max_response_length - buffer`` lose up to ``penalty_factor`` linearly with the excess."""

    enable: bool = False
    buffer: int = 64
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        check_positive("reward.overlong", "buffer", self.buffer)
        check_range("reward.overlong", "penalty_factor", self.penalty_factor, low=0.0)


@dataclass(frozen=True)
class RewardModelSourceConfig:
    """A discriminative reward model as a reward source (``reward.model.*``).

    Attributes:
        path: an HF ``...ForSequenceClassification`` directory with one label (``tandem rm``
            writes one), with its own tokenizer and chat template.
        n_workers: scoring workers, a pool of their own (one in this process with the local
            backend; on GPUs each takes one); each holds the whole model.
        max_length: tokens of prompt and response scored; longer ones keep their end (the
            response) and are counted (``reward/model/truncated``).
        max_tokens_per_micro_batch: the scoring engine's token budget per forward.
        param_dtype: ``float32`` or ``bfloat16``.
    """

    path: str = path_field(MODEL_PATH)
    n_workers: int = 1
    max_length: int = 2048
    max_tokens_per_micro_batch: int = 16384
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_positive("reward.model", "n_workers", self.n_workers)
        check_positive("reward.model", "max_length", self.max_length)
        check_positive("reward.model", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        check_choice("reward.model", "param_dtype", self.param_dtype, ("float32", "bfloat16"))


# What can score a response (``reward.sources``), one name each: every check of a source reads
# these, and docs/rl.md documents each (tests/rl/test_config.py holds the two together).
RULE_SOURCE = "rule"
MODEL_SOURCE = "model"
JUDGE_SOURCE = "judge"
INTERACTION_SOURCE = "interaction"
REWARD_SOURCES = (RULE_SOURCE, MODEL_SOURCE, JUDGE_SOURCE, INTERACTION_SOURCE)


@dataclass(frozen=True)
class RewardConfig:
    """Scoring (``reward.*``).

    Attributes:
        sources: what scores each response, combined by ``weights``: ``rule`` (the function
            below or the built-in scorer of its ``data_source``), ``model`` (a reward model,
            ``reward.model.*``) and ``judge`` (an LLM behind an OpenAI-compatible endpoint,
            ``reward.judge.*``) and ``interaction`` (the reward the ``interaction`` agent loop's
            user function ends an episode with; 0 where it gave none). Each is logged as
            ``reward/<source>/mean``.
        weights: one per source (empty: 1 each); the score is the weighted sum.
        custom_path: a Python file with a scoring function (empty: the built-in scorers by ``data_source``).
        custom_name: the function's name in that file: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``.
        num_workers: threads scoring in parallel.
        timeout_s: per-item time limit; a timeout or an exception scores 0 and counts in ``reward/errors``.
        overlong: DAPO's overlong penalty (on the combined score).
        model: the reward-model source.
        judge: the LLM-judge source.
    """

    sources: tuple[str, ...] = (RULE_SOURCE,)
    weights: tuple[float, ...] = ()
    custom_path: str = path_field(INPUT_PATH)
    custom_name: str = "compute_score"
    num_workers: int = 4
    timeout_s: float = 10.0
    overlong: OverlongPenaltyConfig = field(default_factory=OverlongPenaltyConfig)
    model: RewardModelSourceConfig = field(default_factory=RewardModelSourceConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self) -> None:
        check_positive("reward", "num_workers", self.num_workers)
        check_positive("reward", "timeout_s", self.timeout_s)
        if not self.sources or len(set(self.sources)) != len(self.sources):
            raise ValueError(f"reward.sources={list(self.sources)} must name each source once")
        for source in self.sources:
            check_choice("reward", "sources", source, REWARD_SOURCES)
        if self.weights and len(self.weights) != len(self.sources):
            raise ValueError(
                f"reward.weights={list(self.weights)} needs one weight per source in reward.sources={list(self.sources)}"
            )
        if MODEL_SOURCE in self.sources and not self.model.path:
            raise ValueError(
                f"reward.sources has {MODEL_SOURCE!r}: set reward.model.path (a reward model directory)"
            )
        if JUDGE_SOURCE in self.sources and not self.judge.base_url:
            raise ValueError(
                f"reward.sources has {JUDGE_SOURCE!r}: set reward.judge.base_url (an OpenAI-compatible /v1 URL)"
            )

    @property
    def source_weights(self) -> dict[str, float]:
        """Each source's weight, in ``sources`` order."""
        return dict(zip(self.sources, self.weights or (1.0,) * len(self.sources), strict=True))
