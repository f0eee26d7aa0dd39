"""Run many small calls on daemon threads, each with a time limit; a hung call never blocks the caller or exit.

``concurrent.futures`` cannot abandon a stuck call (its threads are joined at interpreter exit),
so a reward function that hangs would hang the run. Here each worker is a daemon thread, a call
that overruns is reported as timed out, and a fresh thread takes over the remaining work.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class CallResult:
    """The value of one call, or the error (``timeout`` True when it ran past the limit)."""

    value: Any = None
    error: str | None = None
    timeout: bool = False


def run_with_timeouts(
    fn: Callable[..., Any], items: Sequence[tuple], num_threads: int, timeout_s: float
) -> list[CallResult]:
    """``fn(*item)`` for every item, ``num_threads`` at a time, each limited to ``timeout_s`` seconds."""
    results: list[CallResult | None] = [None] * len(items)
    started: dict[int, float] = {}
    lock = threading.Lock()
    work: queue.Queue[int] = queue.Queue()
    for index in range(len(items)):
        work.put(index)

    def worker() -> None:
        while True:
            try:
                index = work.get_nowait()
            except queue.Empty:
                return
            with lock:
                started[index] = time.monotonic()
            try:
                outcome = CallResult(value=fn(*items[index]))
            except Exception as error:  # a user's function may raise anything; it scores 0, counted
                outcome = CallResult(error=f"{type(error).__name__}: {error}")
            with lock:
                if results[index] is None:  # not already declared timed out
                    results[index] = outcome
                started.pop(index, None)

    def spawn() -> None:
        threading.Thread(target=worker, daemon=True, name="tandem-reward").start()

    for _ in range(min(num_threads, len(items))):
        spawn()
    while True:
        with lock:
            if all(r is not None for r in results):
                return results  # type: ignore[return-value]
            now = time.monotonic()
            overdue = [i for i, t in started.items() if now - t > timeout_s and results[i] is None]
            for index in overdue:
                results[index] = CallResult(error=f"timed out after {timeout_s:g} s", timeout=True)
                started.pop(index)
        for _ in overdue:  # the stuck thread is abandoned; another one carries on with the queue
            spawn()
        time.sleep(0.005)
