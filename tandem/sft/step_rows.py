"""What the SFT and DPO trainers hand their workers, and the blocks of a step to release.

With ``dataplane.enabled`` off, a step's collated ``Batch`` itself (today's path). With it on,
the controller collates nothing: it sends a :class:`~tandem.dataplane.BatchRef` of inline per-row
scalars only (the rows' numbers in the data file, their order and widths), and each rank collates
its own rows from the file (:mod:`tandem.sft.rank_collation`, :mod:`tandem.dpo.rank_collation`;
docs/data-plane.md, "In SFT and DPO"). Each rank fetches only the fields its method declares
(``@register(reads=...)``) of only its rows. A worker method declared ``outputs="ref"`` returns a
``BatchRef``: its per-token outputs stay in the rank's store, its per-row ones (a score per row)
come back inline. The controller's sums (token counts, the loss's normalizer) come from per-row
ints it kept at load.

:func:`step_rows` opens the holder for one step (or one validation or reference pass) and
releases every block of it when the step ends, however it ends: the ranks' outputs and any
batch put with :meth:`StepRows.put`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tandem.controller import WorkerGroup
from tandem.dataplane import BatchRef, store_for
from tandem.dataplane import get as get_block
from tandem.dataplane import release as release_block
from tandem.protocol import Batch
from tandem.run.dataplane import TrainerDataPlaneConfig

Rows = Batch | BatchRef  # what a worker call gets


class StepRows:
    """The rows of one step as the workers get them, and the blocks to release after it."""

    def __init__(self, dataplane: TrainerDataPlaneConfig, group: WorkerGroup) -> None:
        self.dataplane = dataplane
        self.group = group
        self._puts: list[BatchRef] = []  # the controller's
        self._outputs: list[BatchRef] = []  # the ranks'

    def put(self, batch: Batch) -> Rows:
        """``batch`` itself (off), or a ``BatchRef`` of it stored once in the controller's store.
        The trainers call it with the setting off only (on, the ranks collate their rows)."""
        if not self.dataplane.enabled:
            return batch
        ref = BatchRef.put(batch, store_for(self.dataplane))
        self._puts.append(ref)
        return ref

    def output(self, result: Any) -> Batch:
        """A worker call's per-row result as a ``Batch``: itself, or a ``BatchRef``'s fields (inline
        scalars; a stored field would be fetched), its blocks released with the step."""
        if not isinstance(result, BatchRef):
            return result
        self._outputs.append(result)
        return result.materialise(get_block)

    def release(self) -> None:
        """Free every block of the step: the controller's and those its ranks kept."""
        for output in self._outputs:
            self.group.release_refs(output)  # on every rank: a Ray block is freed by its putter
        for ref in self._puts:
            ref.release(release_block)
        self._puts.clear()
        self._outputs.clear()


@contextlib.contextmanager
def step_rows(dataplane: TrainerDataPlaneConfig, group: WorkerGroup) -> Iterator[StepRows]:
    """A :class:`StepRows` whose blocks are all released when the ``with`` ends."""
    rows = StepRows(dataplane, group)
    try:
        yield rows
    finally:
        rows.release()


def with_fields(rows: Rows, tensors: dict[str, torch.Tensor]) -> Rows:
    """``rows`` with the per-row ``tensors`` (each ``[B]``) added: assigned to a ``Batch``, held
    inline by a ``BatchRef``."""
    if isinstance(rows, Batch):
        return rows.assign(tensors=tensors)
    return rows.union(BatchRef(Batch(tensors, batch_size=len(rows)), (), {}))
