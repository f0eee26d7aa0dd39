"""``LLMJudge``: rewards graded by an LLM behind an OpenAI-compatible endpoint.

Each response becomes one chat request (``reward.judge.prompt_template`` filled with the task,
the response and the reference answer); the grade is the first group of
``reward.judge.score_pattern`` in the reply, divided by ``max_score``. Requests run
``concurrency`` at a time and are retried ``retries`` times after a connection error, a
timeout, a body cut short, HTTP 429 or 5xx. Whatever still fails scores 0 and is counted with
its reason; a judge never stops a run.

A judge endpoint is treated as untrusted. Each request has one deadline (``timeout_s``) for all
of it, so a server sending a byte at a time cannot hold a step; a reply body is read up to
``max_response_bytes`` and refused past it; a redirect is never followed, so the key and the
task never reach another origin; a grade that is not a finite number within
``[min_score, max_score]`` is refused rather than becoming a reward. Plain ``http.client``: no
client package needed.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
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
        parts = urllib.parse.urlsplit(self.url)
        self.origin = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"
        self._host, self._port, self._path = parts.hostname or "", parts.port, parts.path
        self._https = parts.scheme == "https"
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
            score, error = self._scaled_grade(match.group(1))
            return score, error, attempt
        raise AssertionError("unreachable")

    def _scaled_grade(self, found: str | None) -> tuple[float, str]:
        """``(grade / max_score, "")`` for a finite grade within ``[min_score, max_score]``, else
        ``(0, why)``: an inf or a 400-digit grade would make the loss NaN."""
        low, high = self.config.min_score, self.config.max_score
        try:
            grade = float(found)  # type: ignore[arg-type]  # None (an optional group) is refused below
        except (TypeError, ValueError):
            return 0.0, f"grade {str(found)[:40]!r} is not a number"
        if not (math.isfinite(grade) and low <= grade <= high):
            return 0.0, f"grade {found[:40]!r} is outside the scale [{low:g}, {high:g}]"
        return grade / high, ""

    def _request(self, method: str, path: str, body: dict | None) -> dict:
        """One request to the endpoint and its JSON reply; every failure a ``JudgeRequestError``."""
        status, location, data = self._exchange(method, path, body)
        if 300 <= status < 400:
            raise JudgeRequestError(
                f"HTTP {status} redirect to {location[:200]!r} not followed "
                f"(requests and the key go to {self.origin} only)",
                False,
            )
        if not 200 <= status < 300:
            detail = data.decode(errors="replace")[:200]
            raise JudgeRequestError(f"HTTP {status}: {detail}", status in RETRIED_STATUS)
        try:
            return json.loads(data.decode())
        except ValueError as error:  # JSON or UTF-8
            raise JudgeRequestError(f"unreadable reply: {error}", False) from None

    def _exchange(self, method: str, path: str, body: dict | None) -> tuple[int, str, bytes]:
        """Sends one request and reads the reply's status, ``Location`` and body (at most
        ``max_response_bytes``), all within one deadline of ``timeout_s``."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = kind(self._host, self._port, timeout=self.config.timeout_s)
        try:
            with deadline(connection, self.config.timeout_s) as expired:
                try:
                    connection.connect()
                    if expired.is_set():  # it passed while connecting, before the socket could be shut
                        raise TimeoutError
                    connection.request(method, self._path + path, body=data, headers=headers)
                    response = connection.getresponse()
                    content = read_capped(response, self.config.max_response_bytes)
                    if expired.is_set():  # a close-delimited body ends quietly when the deadline shuts it
                        raise TimeoutError
                    return response.status, response.getheader("Location") or "", content
                except (http.client.HTTPException, OSError, ValueError) as error:
                    raise request_failure(error, expired.is_set(), self.config.timeout_s) from None
        finally:
            connection.close()


@contextlib.contextmanager
def deadline(connection: http.client.HTTPConnection, seconds: float) -> Iterator[threading.Event]:
    """Shuts ``connection``'s socket ``seconds`` from now, ending whatever read or write is under
    way; the yielded event says whether it did. A socket timeout bounds each read alone, which a
    server sending a byte at a time never reaches."""
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        sock = connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                # the plain socket's shutdown, TLS too: it wakes the blocked read and leaves the
                # TLS object to the thread that is using it
                socket.socket.shutdown(sock, socket.SHUT_RDWR)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield expired
    finally:
        timer.cancel()


def read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    """The reply's body, refused past ``limit`` bytes: a declared ``Content-Length`` over it before
    reading, any other body once ``limit + 1`` bytes have arrived, so a huge reply costs at most
    that much memory. A body shorter than its ``Content-Length`` raises ``IncompleteRead``."""
    declared = response.length  # Content-Length; None when chunked or ended by the close
    if declared is not None and declared > limit:
        raise JudgeRequestError(
            f"a reply of {declared} bytes is over reward.judge.max_response_bytes={limit}", False
        )
    content = response.read(limit + 1)
    if len(content) > limit:
        raise JudgeRequestError(f"a reply over reward.judge.max_response_bytes={limit} bytes", False)
    if declared is not None and len(content) < declared:
        raise http.client.IncompleteRead(content, declared - len(content))
    return content


def request_failure(error: Exception, expired: bool, timeout_s: float) -> JudgeRequestError:
    """The judge error for an exception raised while talking to the endpoint; ``expired``: the
    deadline shut the connection, whatever exception that caused."""
    if expired or isinstance(error, TimeoutError):
        return JudgeRequestError(f"no answer within {timeout_s} s (one deadline for the whole request)", True)
    if isinstance(error, http.client.IncompleteRead):
        return JudgeRequestError(f"reply cut short ({error!r})", True)
    if isinstance(error, OSError):  # refused, reset, closed without a reply, TLS
        return JudgeRequestError(f"connection failed: {error}", True)
    if isinstance(error, http.client.HTTPException):  # a malformed status line or headers
        return JudgeRequestError(f"unreadable reply: {type(error).__name__}: {str(error)[:200]}", False)
    # a ValueError from sending, such as a header value with a newline: its text may hold the key
    return JudgeRequestError(f"the request could not be sent ({type(error).__name__})", False)


def prompt_text(messages: Sequence[dict]) -> str:
    """A chat prompt as the judge reads it: each message's content, one per paragraph
    (system messages left out)."""
    return "\n\n".join(str(m.get("content", "")) for m in messages if m.get("role") != "system")
