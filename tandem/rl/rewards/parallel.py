"""Run many small calls on daemon threads, each with a time limit; a hung call never blocks the caller or exit.

Each call runs on a daemon thread of its own (:func:`tandem.user_calls.start_user_call`), at
most ``num_threads`` at a time: a call that overruns is reported as timed out and abandoned, and
the next item takes its place.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tandem.user_calls import UserCodeError, describe_error, start_user_call


@dataclass
class CallResult:
    """The value of one call, or the error (``timeout`` True when it ran past the limit)."""

    value: Any = None
    error: str | None = None
    timeout: bool = False


def run_with_timeouts(
    fn: Callable[..., Any], items: Sequence[tuple], num_threads: int, timeout_s: float
) -> list[CallResult]:
    """``fn(*item)`` for every item, ``num_threads`` at a time, each limited to ``timeout_s``
    seconds from its start. A call that raises gives ``Type: message``; one past its limit is
    abandoned and reported as timed out."""
    results: list[CallResult | None] = [None] * len(items)
    waiting = deque(range(len(items)))
    running: dict[Future, tuple[int, float]] = {}  # the call -> (its item, its deadline)
    while waiting or running:
        while waiting and len(running) < num_threads:
            index = waiting.popleft()
            running[start_user_call(fn, *items[index])] = (index, time.monotonic() + timeout_s)
        next_deadline = min(deadline for _, deadline in running.values())
        done, _ = concurrent.futures.wait(
            running,
            timeout=max(0.0, next_deadline - time.monotonic()),
            return_when=concurrent.futures.FIRST_COMPLETED,
        )
        for call in done:
            index, _ = running.pop(call)
            results[index] = _outcome(call)
        now = time.monotonic()
        for call in [call for call, (_, deadline) in running.items() if now >= deadline]:
            index, _ = running.pop(call)  # its thread is abandoned: the next item takes the place
            results[index] = CallResult(error=f"timed out after {timeout_s:g} s", timeout=True)
    return results  # type: ignore[return-value]


def _outcome(call: Future) -> CallResult:
    """A finished call's value, or what it raised as ``Type: message`` (it scores 0, counted)."""
    error = call.exception()
    if error is None:
        return CallResult(value=call.result())
    raised = error.raised if isinstance(error, UserCodeError) and error.raised is not None else error
    try:
        return CallResult(error=f"{type(raised).__name__}: {raised}")
    except Exception:  # an exception whose str() raises
        return CallResult(error=describe_error(raised))
