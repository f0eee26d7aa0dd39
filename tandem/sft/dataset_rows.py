"""Dataset rows collated where they are read: with ``dataplane.enabled`` the SFT and DPO trainers
hand their ranks a step's rows as row numbers of the data file, and each rank reads, tokenises
and collates its own rows (docs/data-plane.md, "In SFT and DPO").

The controller decides the step: which rows, in which order, their micro-batch units and every
per-row scalar (``pair``, ``chosen``, ``ref_log_prob``, ...), and the padded widths (from the
per-row lengths it kept at load). It sends a :class:`~tandem.dataplane.BatchRef` holding only
those inline scalars, ``dataset_row [B]`` (each row's number in the file) among them, and the
collation's facts in the meta (:data:`ROWS_META`: the split, the pad id, the widths). A rank
builds ``input_ids``, ``attention_mask``, ``loss_mask`` (and ``prompts``) ``[b, S]`` of its
``b`` rows at the step's width ``S``, so its share is exactly the rows the controller's collate
of the whole step would have given it. Nothing of ``[B, S]`` is put into a store or pickled.

A rank opens each split's file once (:class:`RowCollator`, built on the rank from the picklable
factory the trainer passes in the worker's arguments) and keeps the tokenised rows it was asked
for in a bounded cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tandem.dataplane import BatchRef
from tandem.protocol import Batch

ROW_FIELD = "dataset_row"  # per row [B]: its row number in the data file
ROWS_META = "dataset_rows"  # meta: {"split", "pad_id", "widths"} of a step's rows
CACHED_ROWS = 1024  # tokenised rows a rank keeps per split (a step's rows are read twice in DPO)


class RowCollator(Protocol):
    """A split's rows on a rank: ``collate(rows, facts)`` builds the per-token fields of ``rows``
    (the scalars the controller sent: ``dataset_row`` and any per-row field the layout needs)
    at the widths in ``facts`` (the meta's :data:`ROWS_META`); ``routing_fields`` are the sent
    fields that only say where a row comes from (dropped once it is built)."""

    routing_fields: tuple[str, ...]

    def collate(self, rows: Batch, facts: dict[str, Any]) -> Batch: ...


CollatorFactory = Callable[[], RowCollator]  # picklable (a functools.partial of a module function)


def rows_ref(scalars: Batch, split: str, pad_id: int, widths: tuple[int, ...]) -> BatchRef:
    """The ``BatchRef`` a step's worker calls get: ``scalars`` (each ``[B]``, ``dataset_row``
    among them) held inline, with what a rank needs to collate them in the meta."""
    facts = {"split": split, "pad_id": pad_id, "widths": tuple(int(w) for w in widths)}
    return BatchRef(scalars.assign(meta={ROWS_META: facts}), (), {})


class RankRows:
    """A rank's collators, one per split, built on first use from the trainer's factories."""

    def __init__(self, factories: dict[str, CollatorFactory]) -> None:
        self.factories = factories
        self.collators: dict[str, RowCollator] = {}

    def collated(self, batch: Batch) -> Batch:
        """``batch`` itself, or, when it names dataset rows (``dataset_row``), those rows
        collated here: the per-token fields added, the routing fields and the meta's facts dropped."""
        if ROW_FIELD not in batch.keys():
            return batch
        facts = batch.meta[ROWS_META]
        split = facts["split"]
        if split not in self.collators:
            if split not in self.factories:
                raise RuntimeError(f"this rank was given rows of split {split!r} but has no file for it")
            self.collators[split] = self.factories[split]()
        collator = self.collators[split]
        built = collator.collate(batch, facts)
        merged = built.union(batch.select([k for k in batch.keys() if k not in collator.routing_fields]))
        meta = {k: v for k, v in merged.meta.items() if k != ROWS_META}
        return Batch(merged.tensors, non_tensors=dict(merged.non_tensors), meta=meta, batch_size=len(merged))


class TokenCache:
    """``tokenize(file_row)`` remembered for the last :data:`CACHED_ROWS` rows asked for."""

    def __init__(self, tokenize: Callable[[int], Any]) -> None:
        self.tokenize = tokenize
        self.kept: OrderedDict[int, Any] = OrderedDict()

    def __getitem__(self, file_row: int) -> Any:
        if file_row in self.kept:
            self.kept.move_to_end(file_row)
            return self.kept[file_row]
        value = self.kept[file_row] = self.tokenize(file_row)
        if len(self.kept) > CACHED_ROWS:
            self.kept.popitem(last=False)
        return value


def file_rows(rows: Batch) -> list[int]:
    """The ``dataset_row`` of each row, as Python ints."""
    return [int(row) for row in rows[ROW_FIELD].tolist()]


def per_row_ints(values: list[int], indices: list[int]) -> torch.Tensor:
    """``values`` at ``indices`` as a ``[len(indices)]`` int64 tensor."""
    return torch.tensor([values[i] for i in indices], dtype=torch.long)
