"""Decode steps of the native engine replayed from CUDA graphs.

A decode step of a 24-layer model launches several hundred small kernels, and at batch sizes
that keep the GPU memory-bound each takes a few microseconds: the GPU waits on the launches
and on Python between them. A CUDA graph records the step's kernels once and replays them
with one launch. A graph fixes its shapes and the memory it reads and writes, so a step runs
through one only in fixed form:

* **batch buckets** — the step's ``D`` decode tokens are padded to ``B``, a power of two
  (at most the cache's slot count). Padding rows decode token 0 at position 0 into the
  unused slots ``D .. B-1``: running sequences hold slots ``0 .. D-1``, and a slot's cache
  rows are written again (prefill, then decode) before anything attends to them. So the
  engine takes this path only for steps that admit nothing (a request admitted from the
  prefix cache fills a slot ``>= D`` without a prefill);
* **length buckets** — the attended length is rounded up (:func:`graph_length`); keys past a
  sequence's position are masked as in an eager step;
* **static buffers** — the token ids and positions are copied into buffers the graph reads;
  the rotary table is sized for the cache's longest sequence before the capture.

Graphs are captured on first use of a ``(B, L)`` pair and share one memory pool. Capturing a
pair runs the step once eagerly on a side stream (warm-up), records it, and replays it: the
replay rewrites the same keys and values the warm-up wrote (they depend only on the step's
inputs and earlier positions), so its output is the step's output. Freeing the KV cache
(:meth:`SlotKVCache.free`, on sleep) invalidates every graph: :meth:`DecodeGraphs.clear`.
A capture that fails (an operation that cannot be recorded) is logged, and pairs met later
run eagerly (``failure`` says why; graphs recorded before it keep replaying). Recording a pair
costs a warm-up step and PyTorch's capture set-up (a device synchronise, emptying its caches),
paid again after every sleep; how long that takes is not measured yet.

With ``use_cuda_graphs=False`` the same padded, bucketed step runs eagerly every time: the CPU
tests check it against the engine's plain decode, and the GPU tier checks the graphs.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from tandem.rollout.kv_cache import SlotKVCache, StepPlan
from tandem.rollout.lean import LeanDecoder

logger = logging.getLogger(__name__)

LENGTH_STEP = 128


def graph_length(length: int) -> int:
    """``length`` rounded up to a multiple of 128, or of 1/8 of its power of two when longer
    than 2048 (at most 12.5% more keys read beyond 1024 positions)."""
    step = max(LENGTH_STEP, 1 << max(length.bit_length() - 4, 0))
    return -(-length // step) * step


def graph_batch(count: int) -> int:
    """``count`` decode tokens rounded up to a power of two."""
    return 1 << (count - 1).bit_length()


@dataclass
class _Graph:
    """One ``(B, L)`` bucket: its static inputs ``input_ids, positions [B]``, its output
    ``hidden [B, hidden]`` and the recorded graph (``None`` when replayed eagerly)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    hidden: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """``run(input_ids [D], positions [D], length) -> hidden [D, hidden]`` for decode-only steps.

    Args:
        decoder: the engine's lean forward (graphs need its functional layers).
        cache: the engine's KV cache; decode token ``i`` belongs to slot ``i``.
        use_cuda_graphs: record and replay CUDA graphs (the cache must be on CUDA); ``False``
            runs the padded step eagerly.
    """

    def __init__(self, decoder: LeanDecoder, cache: SlotKVCache, use_cuda_graphs: bool = True) -> None:
        if use_cuda_graphs and cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV cache on a CUDA device, not {cache.device}")
        if not decoder.rotary.cacheable:
            raise ValueError("CUDA graphs need a rotary embedding that does not change with the length")
        self.decoder, self.cache, self.use_cuda_graphs = decoder, cache, use_cuda_graphs
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None  # the graphs' shared memory pool, and the stream they are recorded on
        self._capture_stream: torch.cuda.Stream | None = None
        self.captures = 0  # graphs recorded since the engine started (a re-capture counts again)
        self.failure: str | None = None  # why a capture failed, when one did (later pairs run eagerly)

    def __len__(self) -> int:
        return len(self._graphs)

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """The ``(B, L)`` buckets held, in the order they were first met."""
        return list(self._graphs)

    def bucket(self, count: int, length: int) -> tuple[int, int]:
        """The ``(B, L)`` that ``count`` decode tokens attending ``length`` positions run in."""
        if not 0 < count <= self.cache.num_slots:
            raise ValueError(f"{count} decode tokens for a cache of {self.cache.num_slots} slots")
        if not 0 < length <= self.cache.max_len:
            raise ValueError(f"attended length {length} outside 1..{self.cache.max_len}")
        return min(graph_batch(count), self.cache.num_slots), min(graph_length(length), self.cache.max_len)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Decode token ``i`` (``input_ids[i]`` at cache position ``positions[i]`` of slot ``i``;
        ``length`` = the furthest position + 1): store its keys and values, return its last
        hidden state ``[D, hidden]``."""
        count = input_ids.shape[0]
        key = self.bucket(count, length)
        entry = self._graphs.get(key)
        if entry is None:
            batch = key[0]
            device = self.cache.device
            entry = _Graph(
                torch.zeros(batch, dtype=torch.long, device=device),
                torch.zeros(batch, dtype=torch.long, device=device),
            )
        entry.input_ids[:count].copy_(input_ids)
        entry.positions[:count].copy_(positions)
        entry.input_ids[count:].zero_()
        entry.positions[count:].zero_()
        if key not in self._graphs:
            self._record(entry, key[1])
            self._graphs[key] = entry
        elif entry.graph is not None:
            entry.graph.replay()
        else:
            entry.hidden = self._forward(entry, key[1])
        return entry.hidden[:count]

    def clear(self) -> None:
        """Drop every graph and its memory (the KV cache they write is being freed)."""
        self._graphs.clear()
        self._pool = self._capture_stream = None

    def _forward(self, entry: _Graph, length: int) -> torch.Tensor:
        plan = StepPlan(self.cache, (), 0, entry.positions, None, attend_length=length)
        return self.decoder(entry.input_ids, entry.positions, plan, max_position=self.cache.max_len - 1)

    def _record(self, entry: _Graph, length: int) -> None:
        if not self.use_cuda_graphs:
            entry.hidden = self._forward(entry, length)
            return
        try:
            self._capture(entry, length)
        except Exception as error:  # an operation that cannot be captured: eager from now on
            self.use_cuda_graphs = False
            self.failure = f"{type(error).__name__}: {error}"
            logger.warning("CUDA graph capture failed (%s); decode steps run eagerly from now on", self.failure)
            entry.graph = None
            entry.hidden = self._forward(entry, length)  # rewrites what the warm-up wrote: the same values

    def _capture(self, entry: _Graph, length: int) -> None:
        # The engine's thread may not have the cache's GPU as its current device: name it.
        with torch.cuda.device(self.cache.device):
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._capture_stream = torch.cuda.Stream()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: kernels chosen, workspaces and the rotary table allocated
                self._forward(entry, length)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # The outer stream context gives this thread its stream back even when ending the
            # capture raises (torch.cuda.graph's exit then skips its own restore).
            with torch.cuda.stream(self._capture_stream):
                try:
                    # thread_local: other threads (the trainer, a server) may use the GPU meanwhile
                    with torch.cuda.graph(
                        graph, pool=self._pool, stream=self._capture_stream, capture_error_mode="thread_local"
                    ):
                        entry.hidden = self._forward(entry, length)
                except Exception:
                    self._end_failed_capture()
                    raise
            graph.replay()
        entry.graph = graph
        self.captures += 1

    def _end_failed_capture(self) -> None:
        """Tell the caching allocator that the pool's capture is over: when ending a capture
        raises, PyTorch skips that, and while the allocator believes a capture is under way it
        stops recycling blocks freed across streams, for the whole process. The pool itself
        is dropped (its few blocks stay reserved)."""
        end = getattr(torch._C, "_cuda_endAllocateToPool", None)
        if end is not None and self._pool is not None:
            index = self.cache.device.index
            with contextlib.suppress(RuntimeError):  # raised when the capture had ended after all
                end(torch.cuda.current_device() if index is None else index, self._pool)
        self._pool = None
        torch.cuda.synchronize(self.cache.device)
