"""Preference rows collated on the rank that reads them (:mod:`tandem.sft.dataset_rows`): what the
controller keeps and sends for a step's pairs (or KTO's unpaired rows), and the collator a rank
rebuilds them with from the data file.

Each of a pair's ``2`` rows names its prompt's file row (``dataset_row``) and the file row of its
response (``response_row``: the pair's own row in DPO; in KTO the row's own completion, or the
row before it for the mismatched one); ``chosen`` says which of the row's responses it is.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from tandem.data.rows import read_rows
from tandem.dataplane import BatchRef
from tandem.dpo.data import PreferenceDataConfig, PreferenceDataset, pair_layout, tokenize_pair
from tandem.dpo.unpaired import UnpairedDataset, tokenize_unpaired
from tandem.models.loading import load_tokenizer
from tandem.protocol import Batch
from tandem.sft.dataset_rows import ROW_FIELD, CollatorFactory, TokenCache, file_rows, rows_ref

RESPONSE_ROW = "response_row"  # per row [2P]: the file row its response comes from


def controller_view(batch: Batch) -> Batch:
    """A collated batch with the per-row counts the controller reads: ``response_tokens [2P]``
    (its ``loss_mask`` tokens) and ``tokens [2P]`` (its real tokens)."""
    return batch.assign(
        tensors={"response_tokens": batch["loss_mask"].sum(-1), "tokens": batch["attention_mask"].sum(-1)}
    )


def preference_rows(
    dataset: PreferenceDataset, split: str, indices: list[int], pad_id: int
) -> tuple[Batch, BatchRef]:
    """The pairs ``indices`` as the controller sees them (the collated batch's per-row fields and
    counts: :func:`controller_view` without a ``[2P, S]`` tensor) and as the ranks get them."""
    fields = dataset.pair_fields(indices)
    lengths = torch.tensor([dataset.lengths[i] for i in indices], dtype=torch.long)  # [P, 3]
    responses = lengths[:, 1:].reshape(-1)  # chosen, rejected of each pair: [2P]
    own = torch.tensor([dataset.rows[i] for i in indices], dtype=torch.long).repeat_interleave(2)
    routed = {ROW_FIELD: own, RESPONSE_ROW: own}
    if isinstance(dataset, UnpairedDataset):
        partners = torch.tensor([dataset.partner_rows[i] for i in indices], dtype=torch.long)
        routed[RESPONSE_ROW] = torch.stack([own[::2], partners], dim=1).reshape(-1)
        labels = torch.tensor([dataset.desirable[i] for i in indices], dtype=torch.long)
        fields["desirable"] = labels.repeat_interleave(2)
    view = Batch(
        {**fields, "response_tokens": responses, "tokens": responses + lengths[:, 0].repeat_interleave(2)}
    )
    return view, rows_ref(Batch({**routed, **fields}), split, pad_id, dataset.widths(indices))


class PairRowCollator:
    """A split's pairs (``unpaired``: KTO's rows) on a rank: the file read once, a row tokenised
    when first asked for, as the controller's load did."""

    routing_fields = (ROW_FIELD, RESPONSE_ROW)

    def __init__(self, path: str, model_path: str, config: PreferenceDataConfig, unpaired: bool) -> None:
        self.path = path
        self.raw = read_rows(path)
        tokenize = tokenize_unpaired if unpaired else tokenize_pair
        self.tokenize = functools.partial(tokenize, load_tokenizer(model_path), config=config)
        self.unpaired = unpaired
        self.rows = TokenCache(lambda row: self.tokenize(self.raw[row], where=f"{self.path}: row {row}"))

    def _response(self, response_row: int, chosen: bool) -> list[int]:
        tokens = self.rows[response_row]
        if self.unpaired:
            return tokens.completion
        return tokens.chosen if chosen else tokens.rejected

    def collate(self, rows: Batch, facts: dict[str, Any]) -> Batch:
        """:func:`~tandem.dpo.data.pair_layout` of ``rows`` at the step's widths."""
        prompts = [self.rows[row].prompt for row in file_rows(rows)]
        chosen = rows["chosen"].tolist()
        response_rows = rows[RESPONSE_ROW].tolist()
        responses = [self._response(int(r), bool(c)) for r, c in zip(response_rows, chosen, strict=True)]
        width, response_width = facts["widths"]
        return Batch(pair_layout(prompts, responses, width, response_width, facts["pad_id"]))


def pair_collators(
    config: PreferenceDataConfig, model_path: str, unpaired: bool
) -> dict[str, CollatorFactory]:
    """A rank's factories of the training and (when set) validation collators."""
    paths = {"train": config.train_path, "val": config.val_path}
    return {
        split: functools.partial(PairRowCollator, path, model_path, config, unpaired)
        for split, path in paths.items()
        if path
    }
