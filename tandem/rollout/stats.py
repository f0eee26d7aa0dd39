"""Counters an engine keeps for monitoring, with a sliding-window throughput."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

THROUGHPUT_WINDOW_S = 10.0


@dataclass
class EngineStats:
    """Counters for monitoring (the HTTP server's ``/metrics``).

    ``recent`` holds ``(time, tokens generated)`` per step for the last
    ``THROUGHPUT_WINDOW_S`` seconds, from which :meth:`tokens_per_second` is computed.
    """

    steps: int = 0
    generated_tokens: int = 0
    prefilled_tokens: int = 0
    prefix_hits: int = 0
    shared_prefix_steps: int = 0  # decode steps that read each shared prompt once
    graph_steps: int = 0  # decode steps replayed from a CUDA graph (or its eager stand-in)
    finished: dict[str, int] = field(default_factory=collections.Counter)
    recent: collections.deque = field(default_factory=collections.deque)

    def record_step(self, tokens: int, now: float) -> None:
        self.generated_tokens += tokens
        self.recent.append((now, tokens))
        while self.recent and self.recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self.recent.popleft()

    def tokens_per_second(self, now: float) -> float:
        """Generated tokens per second over the last window (0 when idle for a whole window)."""
        recent = [(t, n) for t, n in self.recent if t >= now - THROUGHPUT_WINDOW_S]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span
