"""SFT rows collated on the rank that reads them (:mod:`tandem.sft.dataset_rows`): the
controller's per-row view of a split (:meth:`SFTDataset.load` with ``keep_tokens=False``), what
it sends for a step's rows, and the collator a rank rebuilds the rows with from the file."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.data.rows import read_rows
from tandem.dataplane import BatchRef
from tandem.models.loading import load_tokenizer
from tandem.models.vision import ImagePrompter
from tandem.protocol import Batch
from tandem.sft.data import SFTDataConfig, SFTDataset, tokenize_row
from tandem.sft.dataset_rows import ROW_FIELD, CollatorFactory, TokenCache, file_rows, per_row_ints, rows_ref


@dataclass(frozen=True)
class RowCounts:
    """Per-row token counts of a step the controller needs (each ``[B]``, int64): ``loss_tokens``
    (``loss_mask`` tokens: the loss's normaliser, the evaluation's mean) and ``tokens`` (real
    tokens: throughput)."""

    loss_tokens: torch.Tensor
    tokens: torch.Tensor

    @staticmethod
    def of(batch: Batch) -> RowCounts:
        """The counts of a collated ``batch``."""
        return RowCounts(batch["loss_mask"].sum(-1), batch["attention_mask"].sum(-1))


def sft_rows(dataset: SFTDataset, split: str, indices: list[int], pad_id: int) -> tuple[BatchRef, RowCounts]:
    """The rows ``indices`` of ``dataset`` as the ranks get them (``dataset_row [B]`` inline, the
    step's width in the meta) and their counts, from the per-row ints the controller kept."""
    scalars = Batch({ROW_FIELD: per_row_ints(dataset.rows, indices)})
    lengths = per_row_ints(dataset.lengths, indices)
    counts = RowCounts(per_row_ints(dataset.loss_tokens, indices), lengths)
    return rows_ref(scalars, split, pad_id, (int(lengths.max()),)), counts


class SFTRowCollator:
    """A split's conversations on a rank: the file read once, a row tokenised when first asked
    for (:func:`~tandem.sft.data.tokenize_row`, as the controller's load did)."""

    routing_fields = (ROW_FIELD,)

    def __init__(self, path: str, model_path: str, config: SFTDataConfig) -> None:
        self.path = path
        self.config = config
        self.raw = read_rows(path)
        self.tokenizer = load_tokenizer(model_path)
        self.prompter = ImagePrompter.for_model(model_path, config.min_pixels, config.max_pixels)
        self.samples = TokenCache(self._tokenize)

    def _tokenize(self, file_row: int) -> tuple:
        where = f"{self.path}: row {file_row}"
        sample = tokenize_row(
            self.raw[file_row], self.config, self.tokenizer, self.prompter, Path(self.path).parent, where
        )
        if sample is None:
            raise RuntimeError(f"{where} was dropped at load (data.truncation=drop), yet a step asked for it")
        return sample

    def collate(self, rows: Batch, facts: dict) -> Batch:
        """:meth:`SFTDataset.collate` of ``rows`` at the step's width."""
        samples = [self.samples[row] for row in file_rows(rows)]
        dataset = SFTDataset(
            [(ids, mask) for ids, mask, _ in samples], images=[inputs for *_, inputs in samples]
        )
        (width,) = facts["widths"]
        return dataset.collate(list(range(len(samples))), facts["pad_id"], width)


def sft_collators(config: SFTDataConfig, model_path: str) -> dict[str, CollatorFactory]:
    """A rank's factories of the training and (when set) validation collators."""
    paths = {"train": config.train_path, "val": config.val_path}
    return {
        split: functools.partial(SFTRowCollator, path, model_path, config)
        for split, path in paths.items()
        if path
    }
