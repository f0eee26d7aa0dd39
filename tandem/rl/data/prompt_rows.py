"""RL prompts tokenised on the rank that generates them: with ``dataplane.enabled`` in
``pipeline.mode=sync`` the controller's generation request names each row's place in the data
files (:meth:`RLDataset.requests`: ``prompt_place``, ``(file, row)`` a row, and the dataset's
:class:`~tandem.rl.data.dataset.PromptSource` key in the meta) instead of carrying its
``prompt_ids`` and ``raw_prompt``. The rank knows the run's sources from its own config
(``data.train_path``, ``data.val_path`` and the settings :meth:`RLDataset.load` was given) and
reads and tokenises those rows here with the function the controller's load used
(``prompt_sample``: the same tokenizer, chat template, ``data.special_tokens_in_text`` and
``data.overlong_prompts`` rule), so its ids are the controller's, bit for bit.

The asynchronous pipelines' rollout replicas do the same for their prompt groups (``GroupRequest.place``):
the dataset gives the replicas a :class:`PromptPlaces` (the sources, no tokens) and each replica
reads the ids of the groups it is sent with its own tokenizer of the same model.

A rank reads each file once and keeps the rows it tokenised in a bounded cache
(:class:`~tandem.sft.dataset_rows.TokenCache`, as SFT's and DPO's ranks do). Text prompts only: a
dataset with images sends :meth:`RLDataset.collate`'s rows, which :meth:`RankPrompts.built` passes
through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.data.rows import read_rows
from tandem.protocol import Batch
from tandem.rl.config.data import RLDataConfig
from tandem.rl.data.dataset import (
    PROMPT_PLACE,
    PROMPT_SOURCE,
    PromptSample,
    PromptSource,
    prompt_sample,
)
from tandem.rl.data.images import ImageReader
from tandem.sft.dataset_rows import TokenCache


class SourcePrompts:
    """One :class:`PromptSource`'s rows on a rank: each file read when first asked for, a row
    tokenised when first asked for (and kept in a bounded cache)."""

    def __init__(self, source: PromptSource, tokenizer: Any) -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.reader = ImageReader(model_path="")  # text prompts only (images keep collate's request)
        self.raw: dict[int, list] = {}
        self.samples = TokenCache(self._tokenize)

    def _tokenize(self, place: tuple[int, int]) -> PromptSample:
        number, row = place
        path = Path(self.source.files[number])
        if number not in self.raw:
            self.raw[number] = read_rows(path)
        where = f"{path}: row {row}"
        source = self.source
        sample = prompt_sample(
            self.raw[number][row],
            where,
            self.tokenizer,
            source.max_prompt_length,
            source.overlong,
            self.reader,
            path.parent,
            source.special_tokens_in_text,
        )
        if sample is None:
            raise RuntimeError(
                f"{where} was dropped at load (data.overlong_prompts=filter), yet a request named it"
            )
        return sample

    def __getitem__(self, place: tuple[int, int]) -> PromptSample:
        return self.samples[place]


class RankPrompts:
    """A rank's prompt rows: one :class:`SourcePrompts` per source it knows, by its key."""

    def __init__(self, tokenizer: Any, sources: list[PromptSource]) -> None:
        self.tokenizer = tokenizer
        self.known = {source.key: source for source in sources}
        self.sources: dict[str, SourcePrompts] = {}

    @staticmethod
    def of_config(data: RLDataConfig, tokenizer: Any) -> RankPrompts:
        """The sources of a run's ``data.train_path`` and (when set) ``data.val_path``."""
        paths = [path for path in (data.train_path, data.val_path) if path]
        settings = (data.max_prompt_length, data.overlong_prompts, data.special_tokens_in_text)
        return RankPrompts(tokenizer, [PromptSource.of(path, *settings) for path in paths])

    def samples(self, key: str, places: list[tuple[int, int]]) -> list[PromptSample]:
        """The tokenised rows at ``places`` (``(file, row)`` each) of the source ``key`` names."""
        if key not in self.sources:
            if key not in self.known:
                raise RuntimeError(
                    f"this rank was sent prompt rows of a dataset it has no files of (source {key}; it "
                    f"reads {[s.files for s in self.known.values()]}: data.train_path, data.val_path)"
                )
            self.sources[key] = SourcePrompts(self.known[key], self.tokenizer)
        rows = self.sources[key]
        return [rows[place] for place in places]

    def prompt_ids(self, key: str, places: list[tuple[int, int]]) -> list[tuple[int, ...]]:
        """The token ids of the rows at ``places`` of the source ``key`` names."""
        return [tuple(sample.prompt_ids) for sample in self.samples(key, places)]

    def built(self, requests: Batch) -> Batch:
        """``requests`` itself, or, when its rows name their places (``prompt_place``), those rows
        with ``prompt_ids`` (a tuple of ids a row) and ``raw_prompt`` (the row's messages) read
        here, the places and the meta's source dropped: the rows :meth:`RLDataset.collate`
        would have sent."""
        if PROMPT_PLACE not in requests.keys():
            return requests
        places = [tuple(place) for place in requests[PROMPT_PLACE]]
        samples = self.samples(requests.meta[PROMPT_SOURCE], places)
        columns = {
            "prompt_ids": [s.prompt_ids for s in samples],
            "raw_prompt": [s.raw_prompt for s in samples],
            **{k: v for k, v in requests.non_tensors.items() if k != PROMPT_PLACE},
        }
        meta = {k: v for k, v in requests.meta.items() if k != PROMPT_SOURCE}
        return Batch(dict(requests.tensors.items()), non_tensors=columns, meta=meta, batch_size=len(requests))


@dataclass(frozen=True)
class PromptPlaces:
    """What another process needs to read prompt rows by place (the sources, not their rows; a
    :class:`~tandem.pipeline.requests.PromptPlaces`): pickled to a rollout replica, which builds its
    reader with its own tokenizer of the same model."""

    sources: tuple[PromptSource, ...]

    def reader(self, tokenizer: Any) -> RankPrompts:
        """A reader of these sources' rows, tokenising with ``tokenizer``."""
        return RankPrompts(tokenizer, list(self.sources))
