"""The trainer's side of ``pipeline.stream_forward``: the step plan's streaming passes run on each
chunk of a draw as the batch source hands it over, and the step takes their joined outputs.

The asynchronous batch source hands :class:`ForwardStream` the draw's rows in chunks of prompt
groups while the trainer waits for the rest (:mod:`tandem.pipeline.draw_chunks`; the chunk size is
:func:`tandem.rl.stream_plan.chunk_groups`). For each chunk it runs the plan's streaming passes
(``StepStage.streams``: the same stage functions the step runs, given a :class:`ChunkPasses`
instead of the step's data), whose outputs stay on the ranks that made them. When the step's
passes run (:mod:`tandem.rl.step_data`), :meth:`ForwardStream.outputs_for` gives each streamed
pass's output for the whole draw: the chunks' output references joined in order (no payload is
touched) and cropped to the draw's longest response, and the step keeps that instead of running
the pass again. Every chunk is at the rows' stored widths, so the joined outputs are one
reference; a forward over another padding width can differ from the whole draw's in the last
bits of a log-prob (packed micro-batches of other rows), never more.

Whether a run may stream is decided once, by :mod:`tandem.rl.stream_plan`; what a stage of the
step did to the draw's rows before the passes is checked here: the joined rows must be the
step's, by ``uid`` and request id, row for row.
"""

from __future__ import annotations

from typing import Any

from tandem.dataplane import BatchRef
from tandem.pipeline.provenance import REQUEST_ID
from tandem.rl.step_data import Group, Stage, worker_group
from tandem.rl.stream_plan import chunk_groups

RESPONSES = "responses"  # the stored draw's [B, R] response tokens: its response width


class ChunkPasses:
    """A chunk of a draw as a pass stage's ``data`` (:mod:`tandem.rl.step_data`): ``stage(group,
    method)`` runs ``method`` on the chunk's rows and keeps its output, by the method's name."""

    def __init__(self, chunk: BatchRef) -> None:
        self.first = chunk
        self.batch = chunk.scalars
        self.outputs: dict[str, tuple[Group, BatchRef]] = {}

    def stage(self, group: Group, method: Stage, joined: bool = False) -> None:
        if joined:
            raise ValueError(
                f"a streaming pass reads the draw's rows only; {method.__name__} asks for the step's "
                "earlier outputs too (joined=True): register its stage with streams=False"
            )
        self.outputs[method.__name__] = (group, method(self.first))


class ForwardStream:
    """The chunks' passes of the draw under way (see the module docstring); calling it with a
    chunk runs ``passes`` (stage functions ``(trainer, data, timings)``) on it."""

    def __init__(self, trainer: Any, passes: tuple[Any, ...]) -> None:
        self.trainer = trainer
        self.passes = passes
        self.chunks: list[ChunkPasses] = []
        self.timings: dict[str, float] = {}  # the passes' seconds over the chunks, by timing name

    def __call__(self, chunk: BatchRef) -> None:
        holder = ChunkPasses(chunk)
        self.chunks.append(holder)  # before the passes: a failed chunk's outputs so far are released too
        for stage in self.passes:
            stage(self.trainer, holder, self.timings)

    def outputs_for(self, batch: Any, timings: dict[str, float]) -> dict[str, tuple[Group, BatchRef]]:
        """Each streamed pass's output for the step's ``batch`` (the draw's ``BatchRef``), by method
        name, with the group whose ranks keep it; the passes' seconds are added to ``timings``.
        ``RuntimeError`` when the chunks' rows are not ``batch``'s (a stage reordered or filtered
        them before the passes)."""
        chunks, self.chunks = self.chunks, []
        for name, seconds in self.timings.items():
            timings[name] = timings.get(name, 0.0) + seconds
        self.timings = {}
        if not chunks:
            return {}
        joined = _joined(chunks)
        try:
            _check_same_rows(batch, chunks)
        except RuntimeError:
            for group, output in joined.values():
                worker_group(group).release_refs(output)
            raise
        width = batch.schema[RESPONSES].shape[0]
        stored = chunks[0].first.schema[RESPONSES].shape[0]
        return {name: (group, _cropped(output, stored, width)) for name, (group, output) in joined.items()}


    def discard(self) -> None:
        """Release the outputs of the chunks no step took (the step failed before its passes)."""
        chunks, self.chunks, self.timings = self.chunks, [], {}
        for chunk in chunks:
            for group, output in chunk.outputs.values():
                worker_group(group).release_refs(output)


def stream_forward(trainer: Any) -> ForwardStream | None:
    """With ``pipeline.stream_forward``, a :class:`ForwardStream` of ``trainer``'s plan's streaming
    passes, handed to its batch source (``stream_chunks``); else None."""
    config = trainer.config
    if not config.pipeline.stream_forward:
        return None
    streams = getattr(trainer.rollout, "stream_chunks", None)
    if streams is None:
        raise ValueError(
            f"pipeline.stream_forward=true: this run's batch source ({type(trainer.rollout).__name__}) "
            "does not hand its draws over in chunks"
        )
    stream = ForwardStream(trainer, trainer.plan.streamed_passes)
    streams(chunk_groups(config), stream)
    return stream


def _joined(chunks: list[ChunkPasses]) -> dict[str, tuple[Group, BatchRef]]:
    """Each pass's chunk outputs joined in order, by method name."""
    names = chunks[0].outputs.keys()
    joined = {}
    for name in names:
        group = chunks[0].outputs[name][0]
        joined[name] = (group, BatchRef.concat([chunk.outputs[name][1] for chunk in chunks]))
    return joined


def _check_same_rows(batch: Any, chunks: list[ChunkPasses]) -> None:
    if not isinstance(batch, BatchRef):
        raise RuntimeError("pipeline.stream_forward: the step's draw is not kept in the data plane")
    rows = [
        (uid, request)
        for c in chunks
        for uid, request in zip(c.batch["uid"], c.batch[REQUEST_ID], strict=True)
    ]
    if rows != list(zip(batch["uid"], batch[REQUEST_ID], strict=True)):
        raise RuntimeError(
            "pipeline.stream_forward: the step's rows are not the streamed draw's, in its order (a stage "
            "reordered or filtered them before the passes); set pipeline.stream_forward=false for this plan"
        )


def _cropped(output: BatchRef, stored: int, width: int) -> BatchRef:
    """``output``'s response fields (rows ``[stored, ...]``) cut to the draw's ``width`` columns."""
    windows = {name: (0, 0, width) for name, schema in output.schema.items() if schema.shape[:1] == (stored,)}
    return output.crop(windows)
