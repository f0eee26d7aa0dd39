"""Prompt rows in, rollout requests out, completions back into rows: one helper for every source.

The training prompts reach the pipeline through one narrow interface, :class:`PromptRows` (the
RL dataset is one; the pipeline reads nothing else of it). From a batch of prompt rows,
:func:`rollout_requests` makes one :class:`~tandem.rollout.RolloutRequest` per row (the sync
pipeline's workers and the asynchronous pipelines' validation both build theirs here),
:func:`with_completions` puts the engines' completions back beside their prompts as generation
fields, and :func:`group_requests` makes the asynchronous pipelines' prompt groups: from
:meth:`PromptRows.requests`' rows they name each prompt's place instead of carrying its ids, and
the replica reads them (:func:`read_prompts`, with the :class:`PromptPlaces` the run gave it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

from tandem.pipeline.groups import EpisodePrompt, GroupRequest
from tandem.pipeline.source import StepShape
from tandem.protocol import Batch
from tandem.protocol.fields import PROMPT_IMAGES, PROMPT_PLACE, PROMPT_SOURCE
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import resize_columns, sequence_tensors
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.seeds import derive_seed

GROUP_SEED_TAG = 202  # derive_seed(run seed, this, group serial, response): an async group's seeds


class PromptRows(Protocol):
    """The training prompts, as the pipeline reads them (:class:`tandem.rl.data.RLDataset` is one)."""

    def collate(self, indices: list[int]) -> Batch:
        """The rows ``indices`` as a batch of per-row columns: at least ``prompt_ids`` (a sequence
        of token ids a row) and ``index``; ``raw_prompt`` (chat messages), ``extra_info`` and
        ``agent_name`` for agent episodes; ``images`` (``ImageInputs`` or None a row) when any row
        holds images. Other columns (the reward's ``ground_truth``...) pass through to training."""
        ...

    def requests(self, indices: list[int]) -> Batch:
        """The rows ``indices`` as a generation request for workers that read the prompts
        themselves: :meth:`collate`'s rows, or rows naming their place in the data instead of
        holding ``prompt_ids`` (the RL dataset's text prompts: :meth:`tandem.rl.data.RLDataset.requests`)."""
        ...


class PlaceReader(Protocol):
    """A process's reader of training prompts by place (:class:`tandem.rl.data.prompt_rows.RankPrompts`)."""

    def built(self, requests: Batch) -> Batch:
        """``requests`` whose rows name their places (:meth:`PromptRows.requests`) as the rows
        :meth:`PromptRows.collate` gives (``prompt_ids``; ``images`` when the meta's
        ``prompt_images`` asks); other requests as they are."""
        ...


class PromptPlaces(Protocol):
    """What a rollout replica builds its :class:`PlaceReader` from: the prompts' sources, no rows
    (picklable; :class:`tandem.rl.data.prompt_rows.PromptPlaces`)."""

    def reader(self, tokenizer: Any, model_path: str) -> PlaceReader:
        """A reader tokenising with ``tokenizer`` and processing images with ``model_path``'s
        processor (the replica's own, of the run's model)."""
        ...


def rollout_requests(
    prompts: Batch, seeds: Sequence[int], sampling: SamplingParams, name: str
) -> list[RolloutRequest]:
    """One request per row of ``prompts`` (its ``prompt_ids`` and ``images``), row ``i`` named
    ``<name>-<i>`` and sampled with ``sampling`` under its own seed ``seeds[i]``."""
    images = prompts["images"] if "images" in prompts else [None] * len(prompts)
    return [
        RolloutRequest(f"{name}-{i}", tuple(ids), dataclasses.replace(sampling, seed=int(seed)), pictures)
        for i, (ids, seed, pictures) in enumerate(zip(prompts["prompt_ids"], seeds, images, strict=True))
    ]


def with_completions(
    prompts: Batch, completions: Sequence[Completion], pad_id: int, widths: tuple[int, int] | None = None
) -> Batch:
    """``prompts`` with each row's completion as generation fields (``input_ids``, ``responses``,
    ``response_mask`` ... ``[B, P + R]`` / ``[B, R]``, padded with ``pad_id``:
    :func:`~tandem.protocol.sequences.sequence_tensors`) and its ``finish_reason``. ``widths``:
    ``P`` and ``R`` fixed at ``(prompt_width, response_width)``
    (:func:`~tandem.protocol.sequences.resize_columns`), not the longest prompt and response."""
    tensors = sequence_tensors(prompts["prompt_ids"], list(completions), pad_id)
    if widths is not None:
        tensors = resize_columns(tensors, *widths, pad_id)
    return prompts.assign(
        tensors=tensors, non_tensors={"finish_reason": [c.finish_reason for c in completions]}
    )


def group_requests(rows: Batch, first_serial: int, shape: StepShape, episodes: bool) -> list[GroupRequest]:
    """One prompt group per row of ``rows`` (:meth:`PromptRows.collate`, or :meth:`PromptRows.requests`
    naming each row's place: then a group carries its ``place`` and no ``prompt_ids``), the ``k``-th
    numbered ``first_serial + k`` (its uid ``g<serial>``; its responses' seeds derive from ``shape.seed``,
    :data:`GROUP_SEED_TAG` and the serial). ``episodes``: each response is an agent episode
    starting from the row's messages (by place: no messages, the replica reads them too)."""
    images = rows["images"] if "images" in rows else [None] * len(rows)
    places = rows.get(PROMPT_PLACE)
    requests = []
    for k, index in enumerate(rows["index"]):
        serial = first_serial + k
        seeds = tuple(derive_seed(shape.seed, GROUP_SEED_TAG, serial, i) for i in range(shape.responses))
        messages = tuple(rows["raw_prompt"][k]) if places is None else ()
        episode = (
            EpisodePrompt(messages, dict(rows["extra_info"][k] or {}), rows["agent_name"][k])
            if episodes
            else None
        )
        ids = tuple(rows["prompt_ids"][k]) if places is None else ()
        place = None if places is None else (rows.meta[PROMPT_SOURCE], int(places[k][0]), int(places[k][1]))
        requests.append(
            GroupRequest(f"g{serial}", index, ids, seeds, shape.sampling, episode, images[k], place)
        )
    return requests


def read_prompts(groups: list[GroupRequest], reader: PlaceReader | None, replica: int) -> list[GroupRequest]:
    """``groups`` with every group sent by ``place`` given its ``prompt_ids`` and ``images`` (an agent
    episode's group its messages too), read by ``reader`` (one request per source:
    :meth:`PlaceReader.built`); the others as they are. ``replica``: who reads (for the error when
    it was sent places without a reader)."""
    by_source: dict[str, list[tuple[str, tuple[int, int]]]] = {}  # key -> (uid, (file, row)) each
    for group in groups:
        if group.place is not None:
            key, file, row = group.place
            by_source.setdefault(key, []).append((group.uid, (file, row)))
    if not by_source:
        return groups
    if reader is None:
        raise RuntimeError(
            f"rollout replica {replica} was sent prompt group {next(iter(by_source.values()))[0][0]!r} by "
            "its place in the training data, but no prompt sources to read it from (read_prompts_by_place)"
        )
    read: dict[str, dict[str, Any]] = {}  # uid -> the group's fields read
    for key, placed in by_source.items():
        request = Batch(
            non_tensors={PROMPT_PLACE: [place for _, place in placed]},
            meta={PROMPT_SOURCE: key, PROMPT_IMAGES: True},  # a text row's images: None
        )
        rows = reader.built(request)
        columns = zip(placed, rows["prompt_ids"], rows["images"], rows["raw_prompt"], strict=True)
        for (uid, _), ids, images, messages in columns:
            read[uid] = {"prompt_ids": tuple(ids), "images": images, "messages": tuple(messages)}
    return [_with_read(group, read[group.uid]) if group.uid in read else group for group in groups]


def _with_read(group: GroupRequest, read: dict[str, Any]) -> GroupRequest:
    """``group`` given the ids, images (and, an agent episode's, messages) its place holds."""
    episode = group.episode
    if episode is not None:
        episode = dataclasses.replace(episode, messages=read["messages"])
    return dataclasses.replace(group, prompt_ids=read["prompt_ids"], images=read["images"], episode=episode)


def read_rows(rows: Batch, reader: PlaceReader | None, replica: int) -> Batch:
    """``rows`` (a request batch) with rows naming their places read by ``reader`` into
    :meth:`PromptRows.collate`'s rows; others as they are. ``replica``: who reads (for the error)."""
    if PROMPT_PLACE not in rows:
        return rows
    if reader is None:
        raise RuntimeError(
            f"rollout replica {replica} was sent prompt rows by their place in the training data, but "
            "no prompt sources to read them from (read_prompts_by_place)"
        )
    return reader.built(rows)
