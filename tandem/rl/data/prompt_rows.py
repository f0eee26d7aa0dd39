"""RL prompts tokenised on the rank that generates them: with ``dataplane.enabled`` in
``pipeline.mode=sync`` the controller's generation request names each row's place in the data
files (:meth:`RLDataset.requests`: ``prompt_place``, ``(file, row)`` a row, and the dataset's
:class:`~tandem.rl.data.dataset.PromptSource` key in the meta) instead of carrying its
``prompt_ids`` and ``raw_prompt``. The rank knows the run's sources from its own config
(``data.train_path``, ``data.val_path`` and the settings :meth:`RLDataset.load` was given) and
reads and tokenises those rows here with the function the controller's load used
(``prompt_sample``: the same tokenizer, chat template, ``data.special_tokens_in_text`` and
``data.overlong_prompts`` rule), so its ids are the controller's, bit for bit. A row's images
are read from the file too and processed by the rank's image processor of the run's model
(``data.image.*``, ``data.image_key``, ``data.video_key`` are part of the source), as
:meth:`RLDataset.collate` processes them on the controller.

The asynchronous pipelines' rollout replicas do the same for their prompt groups (``GroupRequest.place``):
the run gives the replicas a :class:`PromptPlaces` (the sources, no rows) and each replica reads
the ids and images of the groups it is sent with its own tokenizer and processor of the same model.

A rank reads each file once and keeps the rows it tokenised in a bounded cache
(:class:`~tandem.sft.dataset_rows.TokenCache`, as SFT's and DPO's ranks do; a row keeps its
encoded images, processed again for each request, as on the controller). A dataset not built by
:meth:`RLDataset.load` sends :meth:`RLDataset.collate`'s rows, which :meth:`RankPrompts.built`
passes through unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.data.rows import read_rows
from tandem.models.vision import ImagePrompter
from tandem.protocol import Batch
from tandem.protocol.fields import PROMPT_IMAGES, PROMPT_PLACE, PROMPT_SOURCE
from tandem.protocol.images import ImageInputs
from tandem.rl.config.data import RLDataConfig
from tandem.rl.data.dataset import PromptSample, PromptSource, prompt_sample
from tandem.rl.data.images import ImageReader
from tandem.sft.dataset_rows import TokenCache


class SourcePrompts:
    """One :class:`PromptSource`'s rows on a rank: each file read when first asked for, a row
    tokenised when first asked for (and kept in a bounded cache)."""

    def __init__(self, source: PromptSource, tokenizer: Any, model_path: str = "") -> None:
        self.source = source
        self.tokenizer = tokenizer
        self.model_path = model_path  # the run's model, whose processor reads images ("": text only)
        self._reader: ImageReader | None = None
        self.raw: dict[int, list] = {}
        self.samples = TokenCache(self._tokenize)

    @property
    def reader(self) -> ImageReader:
        """The source's image reader with the model's prompter (built when first needed; a model
        without a vision tower has none, and its rows may not hold images)."""
        if self._reader is None:
            image = self.source.image
            prompter = (
                ImagePrompter.for_model(self.model_path, image.min_pixels, image.max_pixels)
                if self.model_path
                else None
            )
            self._reader = self.source.image_reader(prompter)
        return self._reader

    def images(self, sample: PromptSample) -> ImageInputs | None:
        """``sample``'s images processed for the model, as :meth:`RLDataset.image_inputs` does."""
        return self.reader.inputs(sample.images)

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
    """A rank's prompt rows: one :class:`SourcePrompts` per source it knows, by its key;
    ``model_path``: the run's model, whose image processor reads a row's images ("": text only)."""

    def __init__(self, tokenizer: Any, sources: list[PromptSource], model_path: str = "") -> None:
        self.tokenizer = tokenizer
        self.model_path = model_path
        self.known = {source.key: source for source in sources}
        self.sources: dict[str, SourcePrompts] = {}

    @staticmethod
    def of_config(data: RLDataConfig, tokenizer: Any, model_path: str = "") -> RankPrompts:
        """The sources of a run's ``data.train_path`` and (when set) ``data.val_path``."""
        paths = [path for path in (data.train_path, data.val_path) if path]
        settings = (
            data.max_prompt_length, data.overlong_prompts, data.special_tokens_in_text, data.image,
            data.image_key, data.video_key,
        )  # fmt: skip
        return RankPrompts(tokenizer, [PromptSource.of(path, *settings) for path in paths], model_path)

    def source(self, key: str) -> SourcePrompts:
        """The rows of the source ``key`` names (``RuntimeError`` for a source this rank lacks)."""
        if key not in self.sources:
            if key not in self.known:
                raise RuntimeError(
                    f"this rank was sent prompt rows of a dataset it has no files of (source {key}; it "
                    f"reads {[s.files for s in self.known.values()]}: data.train_path, data.val_path)"
                )
            self.sources[key] = SourcePrompts(self.known[key], self.tokenizer, self.model_path)
        return self.sources[key]

    def samples(self, key: str, places: list[tuple[int, int]]) -> list[PromptSample]:
        """The tokenised rows at ``places`` (``(file, row)`` each) of the source ``key`` names."""
        rows = self.source(key)
        return [rows[place] for place in places]

    def built(self, requests: Batch) -> Batch:
        """``requests`` itself, or, when its rows name their places (``prompt_place``), those rows
        with ``prompt_ids`` (a tuple of ids a row), ``raw_prompt`` (the row's messages) and, for a
        source with images (the meta's ``prompt_images``), ``images`` read here, the places and the
        meta's keys dropped: the rows :meth:`RLDataset.collate` would have sent."""
        if PROMPT_PLACE not in requests.keys():
            return requests
        key = requests.meta[PROMPT_SOURCE]
        places = [tuple(place) for place in requests[PROMPT_PLACE]]
        samples = self.samples(key, places)
        columns = {
            "prompt_ids": [s.prompt_ids for s in samples],
            "raw_prompt": [s.raw_prompt for s in samples],
            **{k: v for k, v in requests.non_tensors.items() if k != PROMPT_PLACE},
        }
        if requests.meta.get(PROMPT_IMAGES):  # a group's rows share their prompt's one ImageInputs
            rows = self.source(key)
            processed = {
                place: rows.images(s) for place, s in dict(zip(places, samples, strict=True)).items()
            }
            columns["images"] = [processed[place] for place in places]
        meta = {k: v for k, v in requests.meta.items() if k not in (PROMPT_SOURCE, PROMPT_IMAGES)}
        return Batch(dict(requests.tensors.items()), non_tensors=columns, meta=meta, batch_size=len(requests))


@dataclass(frozen=True)
class PromptPlaces:
    """What another process needs to read prompt rows by place (the sources, not their rows; a
    :class:`~tandem.pipeline.requests.PromptPlaces`): pickled to a rollout replica, which builds its
    reader with its own tokenizer and image processor of the same model."""

    sources: tuple[PromptSource, ...]

    def reader(self, tokenizer: Any, model_path: str) -> RankPrompts:
        """A reader of these sources' rows, tokenising with ``tokenizer`` and processing images
        with ``model_path``'s processor."""
        return RankPrompts(tokenizer, list(self.sources), model_path)
