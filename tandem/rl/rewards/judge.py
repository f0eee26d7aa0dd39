"""``LLMJudge``: rewards graded by an LLM behind an OpenAI-compatible endpoint.

Each response becomes one chat request (``reward.judge.prompt_template`` filled with the task,
the response and the reference answer); the grade is the first group of
``reward.judge.score_pattern`` in the reply, divided by ``max_score``. Requests run
``concurrency`` at a time, each with ``timeout_s``, and are retried ``retries`` times after a
connection error, a timeout, HTTP 429 or 5xx. Whatever still fails — no answer, an HTTP error,
a reply without a grade — scores 0 and is counted with its reason; a judge never stops a run.
Plain ``urllib``: no client package needed.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tandem.rl.judge_config import JudgeConfig

RETRIED_STATUS = (429, 500, 502, 503, 504)


@dataclass
class JudgeResult:
    """``scores [B]`` (0 where the judge failed), one error message per failed item, and how
    many tries were repeated."""

    scores: torch.Tensor
    errors: list[str]
    retries: int

    def metrics(self) -> dict[str, float]:
        return {"reward/judge/errors": float(len(self.errors)), "reward/judge/retries": float(self.retries)}


class JudgeRequestError(RuntimeError):
    """A request that failed; ``retry`` says whether another try may succeed."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.retry = retry


class LLMJudge:
    """Grades responses through the endpoint in ``config`` (see the module docstring)."""

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        self.url = config.base_url.rstrip("/")
        self.api_key = config.api_key or os.environ.get("TANDEM_JUDGE_API_KEY", "")
        self.pattern = re.compile(config.score_pattern)
        self._model = config.model

    @property
    def model(self) -> str:
        """The model id requests name: ``reward.judge.model``, else the endpoint's first."""
        if not self._model:
            listed = self._request("GET", "/models", None)["data"]
            if not listed:
                raise RuntimeError(f"reward.judge.base_url={self.url}: GET /models lists no model")
            self._model = listed[0]["id"]
        return self._model

    def score(
        self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[str]
    ) -> JudgeResult:
        """Grade each ``(prompt, response, ground_truth)``; ``scores [B]`` in ``[.., 1]`` when the
        grades are within ``max_score``."""
        items = list(zip(prompts, responses, ground_truths, strict=True))
        try:
            model = self.model
        except Exception as error:  # the endpoint is down: every item fails, the run goes on
            message = f"the judge at {self.url} did not answer: {error}"
            return JudgeResult(torch.zeros(len(items)), [message] * len(items), 0)
        with ThreadPoolExecutor(max_workers=self.config.concurrency) as pool:
            outcomes = list(pool.map(lambda item: self._grade(model, *item), items))
        errors = [f"item {i}: {error}" for i, (_, error, _) in enumerate(outcomes) if error]
        scores = torch.tensor([score for score, _, _ in outcomes], dtype=torch.float32)
        return JudgeResult(scores, errors, sum(retries for _, _, retries in outcomes))

    def _grade(self, model: str, prompt: str, response: str, truth: str) -> tuple[float, str, int]:
        """``(score, error or "", repeated tries)`` of one item."""
        content = self.config.prompt_template.format(prompt=prompt, response=response, ground_truth=truth)
        body = {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.config.max_tokens,
            "temperature": self.config.temperature,
        }
        tries = self.config.retries + 1
        for attempt in range(tries):
            try:
                reply = self._request("POST", "/chat/completions", body)
            except JudgeRequestError as error:
                if not error.retry or attempt == tries - 1:
                    return 0.0, f"{error} (after {attempt + 1} tries)", attempt
                time.sleep(min(0.2 * 2**attempt, 2.0))
                continue
            try:
                text = str(reply["choices"][0]["message"].get("content") or "")
            except (KeyError, IndexError, TypeError, AttributeError):
                return 0.0, f"unreadable reply {str(reply)[:80]!r}", attempt
            match = self.pattern.search(text)
            if match is None:
                return 0.0, f"no grade in the judge's reply {text[:80]!r}", attempt
            return float(match.group(1)) / self.config.max_score, "", attempt
        raise AssertionError("unreachable")

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as answer:
                return json.loads(answer.read().decode())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:200]
            raise JudgeRequestError(f"HTTP {error.code}: {detail}", error.code in RETRIED_STATUS) from None
        except TimeoutError as error:
            raise JudgeRequestError(f"no answer within {self.config.timeout_s} s ({error})", True) from None
        except (urllib.error.URLError, ConnectionError) as error:
            raise JudgeRequestError(f"connection failed: {error}", True) from None
        except (json.JSONDecodeError, KeyError, ValueError) as error:
            raise JudgeRequestError(f"unreadable reply: {error}", False) from None


def prompt_text(messages: Sequence[dict]) -> str:
    """A chat prompt as the judge reads it: each message's content, one per paragraph
    (system messages left out)."""
    return "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role") != "system")
