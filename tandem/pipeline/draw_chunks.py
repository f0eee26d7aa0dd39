"""A draw's prompt groups handed to the trainer in chunks as they finish (``pipeline.stream_forward``).

The asynchronous pipelines' trainer waits in :meth:`tandem.pipeline.runner.AsyncRollout.next_batch`
until a step's groups are all generated. With the data plane on, the groups already finished are
references into the replicas' blocks, so the trainer's ranks may run their forward-only passes on
them while the rest are still generating. :class:`DrawChunks` is that one seam on the source's
side: the sample queue hands it every ``groups`` fresh groups taken during the wait
(:meth:`tandem.pipeline.sample_queue.SampleQueue.take`'s ``on_chunk``), and once the draw is
complete :meth:`DrawChunks.finish` hands over the rest as one chunk (nothing is left to overlap
then, so one call does it), so every row of the draw reaches the consumer exactly once, in the
draw's row order. A draw none of whose chunks was handed over during the wait (its groups were all
queued already) hands over nothing: the step runs its passes on the whole draw, as without
streaming.

Each chunk is a ``BatchRef`` (:func:`chunk_ref`) at the widths the replicas stored the rows at
(the training set's widest prompt, ``rollout.max_response_length``): every chunk's per-token
outputs then have one width and join into the draw's (cropped to its own longest response by the
consumer). What the consumer does with a chunk is its own affair (the RL trainer's passes:
:mod:`tandem.rl.stream_forward`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tandem.dataplane import BatchRef
from tandem.pipeline.assemble import assemble_stored
from tandem.pipeline.requests import PromptRows
from tandem.pipeline.sample_queue import GroupMeta
from tandem.pipeline.stored_rollout import concat_stored

ChunkConsumer = Callable[[BatchRef], None]  # a chunk of a draw's rows (stored widths), in draw order

STREAMED_ROWS = "pipeline/streamed_rows"  # rows whose chunk was handed over before the draw was complete
STREAM_FORWARD_S = "pipeline/stream_forward_s"  # seconds the consumer took over the draw's chunks


def chunk_ref(groups: list[GroupMeta], prompts: PromptRows, n: int) -> BatchRef:
    """The training rows of ``groups`` as :func:`assemble_stored` gives them, uncropped to the
    widths their blocks hold (the same for every chunk of a run)."""
    return concat_stored([assemble_stored(groups, prompts, n)])


class DrawChunks:
    """One draw's chunks of ``groups`` prompt groups (``n`` rows each) for ``consumer`` (see the
    module docstring); its call is the sample queue's ``on_chunk``."""

    def __init__(self, consumer: ChunkConsumer, groups: int, prompts: PromptRows, n: int) -> None:
        if groups <= 0:
            raise ValueError(f"a chunk holds at least one prompt group, got {groups}")
        self.consumer = consumer
        self.groups = groups
        self.prompts = prompts
        self.n = n
        self.handed = 0  # groups handed over so far
        self.streamed_rows = 0  # rows handed over while the draw was still being generated
        self.busy_waiting_s = 0.0  # the consumer's seconds during the wait
        self.busy_s = 0.0  # the consumer's seconds in all

    def take_args(self) -> dict:
        """The sample queue's ``take`` arguments that stream the wait's groups here."""
        return {"chunk": self.groups, "on_chunk": self}

    def __call__(self, groups: list[GroupMeta]) -> None:
        seconds = self._hand(groups)
        self.busy_waiting_s += seconds
        self.streamed_rows += len(groups) * self.n

    def finish(self, groups: list[GroupMeta]) -> None:
        """The draw is complete (``groups``, in order; the first :attr:`handed` already handed
        over): hand over the rest as one chunk, unless nothing was handed over during the wait."""
        if 0 < self.handed < len(groups):
            self._hand(groups[self.handed :])

    def metrics(self, waited_s: float) -> dict[str, float]:
        """The draw's ``pipeline/*`` streaming metrics; ``pipeline/trainer_idle_s``: the wait's
        ``waited_s`` less the consumer's time in it (the trainer worked then)."""
        return {
            "pipeline/trainer_idle_s": max(waited_s - self.busy_waiting_s, 0.0),
            STREAMED_ROWS: float(self.streamed_rows),
            STREAM_FORWARD_S: self.busy_s,
        }

    def _hand(self, groups: list[GroupMeta]) -> float:
        started = time.monotonic()
        self.consumer(chunk_ref(groups, self.prompts, self.n))
        self.handed += len(groups)
        seconds = time.monotonic() - started
        self.busy_s += seconds
        return seconds
