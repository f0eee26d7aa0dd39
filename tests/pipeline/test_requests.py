"""The pipeline reads the training prompts only through ``PromptRows.collate``: the asynchronous
prompt groups made from collated rows equal those the runner used to make from the dataset's
samples one by one (its own fields, the reference below), agent episodes included; and the
per-row rollout requests carry each row's prompt, images and seed."""

import dataclasses

import pytest

from tandem.models.loading import load_tokenizer
from tandem.pipeline.groups import EpisodePrompt, GroupRequest
from tandem.pipeline.requests import GROUP_SEED_TAG, group_requests, rollout_requests
from tandem.pipeline.source import StepShape
from tandem.rl.data import RLDataset
from tandem.rollout import SamplingParams
from tandem.seeds import derive_seed

SHAPE = StepShape(groups=3, responses=2, sampling=SamplingParams(temperature=1.0, max_tokens=5), seed=11)


@pytest.fixture(scope="module")
def dataset(rl_files):
    return RLDataset.load(rl_files["train"], load_tokenizer(rl_files["model"]), 64)


def _from_samples(dataset, indices, first_serial, episodes):
    """The groups as the runner built them before, reading ``dataset.samples`` directly."""
    requests = []
    for serial, index in enumerate(indices, start=first_serial):
        sample = dataset.samples[index]
        seeds = tuple(derive_seed(SHAPE.seed, GROUP_SEED_TAG, serial, i) for i in range(SHAPE.responses))
        episode = (
            EpisodePrompt(tuple(sample.raw_prompt), dict(sample.extra_info or {}), sample.agent_name)
            if episodes
            else None
        )
        images = dataset.image_inputs(sample)
        requests.append(
            GroupRequest(
                f"g{serial}", index, tuple(sample.prompt_ids), seeds, SHAPE.sampling, episode, images
            )
        )
    return requests


@pytest.mark.parametrize("episodes", [False, True])
def test_group_requests_from_collated_rows_equal_the_ones_read_from_the_samples(dataset, episodes):
    indices = [4, 0, 7]
    made = group_requests(dataset.collate(indices), 5, SHAPE, episodes)
    assert made == _from_samples(dataset, indices, 5, episodes)
    assert [g.uid for g in made] == ["g5", "g6", "g7"]


def test_rollout_requests_carry_each_rows_prompt_and_seed(dataset):
    prompts = dataset.collate([2, 3])
    requests = rollout_requests(prompts, [9, 4], SHAPE.sampling, "val-1")
    assert [r.request_id for r in requests] == ["val-1-0", "val-1-1"]
    assert [r.prompt_ids for r in requests] == [tuple(dataset.samples[i].prompt_ids) for i in (2, 3)]
    assert [r.params for r in requests] == [dataclasses.replace(SHAPE.sampling, seed=s) for s in (9, 4)]
