"""``JudgeConfig``: an LLM behind an OpenAI-compatible endpoint as a reward source (``reward.judge.*``)."""

from __future__ import annotations

import re
import string
import urllib.parse
from dataclasses import dataclass

from tandem.config.validation import check_positive, check_range

DEFAULT_TEMPLATE = (
    "Grade the response to the task from 0 to 10 (10: fully correct and helpful). "
    "Reply with 'Score: N' only.\n\nTask:\n{prompt}\n\nReference answer: {ground_truth}\n\n"
    "Response:\n{response}"
)
PLACEHOLDERS = ("prompt", "response", "ground_truth")


@dataclass(frozen=True)
class JudgeConfig:
    """The generative judge (``reward.judge.*``).

    Attributes:
        base_url: the endpoint's ``/v1`` URL (``tandem serve``, vLLM, any OpenAI-compatible server),
            ``http://`` or ``https://``. Requests go to its origin only: a redirect is never
            followed (the key would go with it) and counts as a judge error.
        model: the model id to ask for (empty: the first one ``GET /models`` lists).
        api_key: sent as ``Authorization: Bearer``; empty: the ``TANDEM_JUDGE_API_KEY``
            environment variable, or none.
        prompt_template: the user message, with ``{prompt}`` (the task's messages as text),
            ``{response}`` and ``{ground_truth}``; literal braces doubled.
        score_pattern: a regular expression whose first group is the grade, searched in the
            judge's reply.
        max_score: the grade is divided by it (the reward is ``grade / max_score``).
        min_score: the lowest grade accepted. A grade outside ``[min_score, max_score]``, NaN,
            infinite or not a number is a judge error (scores 0): it never becomes a reward.
        max_tokens / temperature: the judge's sampling.
        concurrency: requests in flight at once.
        timeout_s: one deadline per request, for all of it (connecting, sending, the headers
            and the whole body), however slowly the server sends; a request that times out or
            fails is retried, each try with a deadline of its own.
        max_response_bytes: the largest reply body read; a longer one (declared or sent) is a
            judge error, not retried, and costs at most this much memory.
        retries: further tries after a failed request (connection error, timeout, HTTP 5xx or
            429, a body cut short). An item whose tries all fail, or whose reply holds no usable
            grade, scores 0 and is counted (``reward/judge/errors``, in ``reward/errors`` too):
            never fatal.
    """

    base_url: str = ""
    model: str = ""
    api_key: str = ""
    prompt_template: str = DEFAULT_TEMPLATE
    score_pattern: str = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
    max_score: float = 10.0
    min_score: float = 0.0
    max_tokens: int = 16
    temperature: float = 0.0
    concurrency: int = 8
    timeout_s: float = 30.0
    retries: int = 2
    max_response_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        self._check_base_url()
        names = {
            field for _, field, _, _ in string.Formatter().parse(self.prompt_template) if field is not None
        }
        unknown = sorted(names - set(PLACEHOLDERS))
        if unknown:
            raise ValueError(
                f"reward.judge.prompt_template has placeholders {unknown}; it may use {list(PLACEHOLDERS)} "
                "(double literal braces)"
            )
        try:
            pattern = re.compile(self.score_pattern)
        except re.error as error:
            raise ValueError(
                f"reward.judge.score_pattern={self.score_pattern!r} is not a regular expression: {error}"
            ) from None
        if pattern.groups < 1:
            raise ValueError(
                f"reward.judge.score_pattern={self.score_pattern!r} needs a group around the grade"
            )
        check_positive("reward.judge", "max_score", self.max_score)
        check_range("reward.judge", "min_score", self.min_score, high=self.max_score, high_inclusive=False)
        check_positive("reward.judge", "max_tokens", self.max_tokens)
        check_range("reward.judge", "temperature", self.temperature, low=0.0)
        check_positive("reward.judge", "concurrency", self.concurrency)
        check_positive("reward.judge", "timeout_s", self.timeout_s)
        check_range("reward.judge", "retries", self.retries, low=0)
        check_positive("reward.judge", "max_response_bytes", self.max_response_bytes)

    def _check_base_url(self) -> None:
        """An ``http(s)://host...`` URL, or empty (no judge)."""
        if not self.base_url:
            return
        parts = urllib.parse.urlsplit(self.base_url)
        try:
            parts.port  # noqa: B018 -- raises on a port that is not a number in range
        except ValueError as error:
            raise ValueError(f"reward.judge.base_url={self.base_url!r}: {error}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"reward.judge.base_url={self.base_url!r} is not an http:// or https:// URL with a host"
            )
