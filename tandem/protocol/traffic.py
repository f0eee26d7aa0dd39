"""Per-process counters of the :class:`~tandem.protocol.Batch` payload bytes this process serialised.

Every transport a ``Batch`` takes out of a process (a pipe's pickle, Ray's pickle, a
shared-memory file) goes through :func:`tandem.protocol.serialize.to_buffers`, and every one
into a process through :func:`~tandem.protocol.serialize.from_bytes`; both add the bytes of
the batch's tensors and of its pickled Python columns here. The data plane's measure,
*payload bytes handled by the controller*, is the controller's two counters: 0 when only
references travel.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchTraffic:
    """Bytes of the batches this process serialised (sent) and rebuilt (received): tensor payloads
    plus the pickle of their per-sample Python columns and meta."""

    serialised: int = 0
    deserialised: int = 0

    def __sub__(self, earlier: BatchTraffic) -> BatchTraffic:
        return BatchTraffic(self.serialised - earlier.serialised, self.deserialised - earlier.deserialised)

    @property
    def total(self) -> int:
        return self.serialised + self.deserialised


_lock = threading.Lock()
_counts = [0, 0]


def count_batch_bytes(serialised: int = 0, deserialised: int = 0) -> None:
    """Add to this process's counters (called by the serialiser only)."""
    with _lock:
        _counts[0] += serialised
        _counts[1] += deserialised


def batch_traffic() -> BatchTraffic:
    """This process's counters since it started; subtract two readings for a window."""
    with _lock:
        return BatchTraffic(*_counts)
