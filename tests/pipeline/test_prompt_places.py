"""The asynchronous pipelines' prompt groups by place: with the data plane on, the controller sends
each group's place in the training data and no token ids or images, and the replica reads,
tokenises and processes the row itself. Reference: the groups made from collated rows (the ids and
images the controller used to send)."""

import dataclasses
import pickle

import pytest
import torch

from tandem.models.loading import load_tokenizer
from tandem.pipeline import fleet
from tandem.pipeline.requests import group_requests, read_prompts, read_rows
from tandem.pipeline.source import StepShape
from tandem.rl import batch_source
from tandem.rl.data import RLDataset, image_reader
from tandem.rl.data.prompt_rows import PromptPlaces
from tandem.rl.trainer import RLTrainer
from tandem.rollout import SamplingParams
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_vlm_grpo import vlm_config, vlm_files  # noqa: F401 (the tiny VLM and its shapes data)

SHAPE = StepShape(groups=3, responses=2, sampling=SamplingParams(temperature=1.0, max_tokens=5), seed=11)


@pytest.fixture(scope="module")
def dataset(rl_files):
    return RLDataset.load(rl_files["train"], load_tokenizer(rl_files["model"]), 64)


def test_groups_by_place_read_on_the_replica_equal_the_groups_carrying_ids(dataset, rl_files):
    indices = list(range(len(dataset)))[::-1]  # every row, out of order
    by_ids = group_requests(dataset.collate(indices), 5, SHAPE, episodes=False)
    by_place = group_requests(dataset.requests(indices), 5, SHAPE, episodes=False)
    assert all(g.prompt_ids == () and g.place is not None for g in by_place)
    assert {g.place[0] for g in by_place} == {dataset.source.key}

    places = pickle.loads(pickle.dumps(PromptPlaces((dataset.source,))))  # as a replica gets it
    reader = places.reader(load_tokenizer(rl_files["model"]), rl_files["model"])  # the replica's own
    read = read_prompts(by_place, reader, replica=0)
    assert [dataclasses.replace(g, place=None) for g in read] == by_ids
    assert len(pickle.dumps(by_place)) < len(pickle.dumps(by_ids))


def test_agent_groups_by_place_read_their_messages_on_the_replica(dataset, rl_files):
    """An agent episode's group by place carries its row's ``extra_info`` and loop name, not its
    messages: the replica reads those with the ids, and the groups equal the ones carrying the rows."""
    indices = [3, 0, 7]
    by_rows = group_requests(dataset.collate(indices), 2, SHAPE, episodes=True)
    by_place = group_requests(dataset.requests(indices), 2, SHAPE, episodes=True)
    assert all(g.episode.messages == () and g.prompt_ids == () for g in by_place)
    assert all(g.episode.messages for g in by_rows)
    reader = PromptPlaces((dataset.source,)).reader(load_tokenizer(rl_files["model"]), rl_files["model"])
    read = read_prompts(pickle.loads(pickle.dumps(by_place)), reader, replica=0)
    assert [dataclasses.replace(g, place=None) for g in read] == by_rows


def test_groups_carrying_ids_pass_through_and_places_without_a_reader_are_refused(dataset):
    by_ids = group_requests(dataset.collate([0, 1]), 0, SHAPE, episodes=False)
    assert read_prompts(by_ids, None, replica=3) is by_ids
    by_place = group_requests(dataset.requests([0, 1]), 0, SHAPE, episodes=False)
    with pytest.raises(RuntimeError, match=r"rollout replica 3 was sent prompt group 'g0' by its place"):
        read_prompts(by_place, None, replica=3)


def test_request_rows_by_place_read_on_the_replica_equal_the_collated_rows(dataset, rl_files):
    """ReMax's greedy requests to the replicas (``generate_to_store``): rows named by place, read
    there (``read_rows``), are the rows ``collate`` gives the controller."""
    indices = [5, 1, 1, 3]
    collated = dataset.collate(indices)
    assert read_rows(collated, None, replica=0) is collated  # rows with ids pass through
    request = dataset.requests(indices)
    with pytest.raises(RuntimeError, match="rollout replica 1 was sent prompt rows by their place"):
        read_rows(request, None, replica=1)
    reader = PromptPlaces((dataset.source,)).reader(load_tokenizer(rl_files["model"]), rl_files["model"])
    read = read_rows(pickle.loads(pickle.dumps(request)), reader, replica=0)
    assert {k: list(read[k]) for k in read.keys()} == {k: list(collated[k]) for k in collated.keys()}


def test_a_dataset_the_replicas_cannot_read_by_place_keeps_sending_ids(rl_files, tmp_path):
    config = small_config(rl_files, tmp_path, "pipeline.mode=fully_async")
    tokenizer = load_tokenizer(rl_files["model"])
    data = RLDataset.load(rl_files["train"], tokenizer, 64)
    assert batch_source.prompt_places(config, data) == PromptPlaces((data.source,))
    agents = small_config(
        rl_files, tmp_path, "pipeline.mode=fully_async", "agent.name=tool_agent", "agent.tools=[calculator]"
    )
    assert batch_source.prompt_places(agents, data) == PromptPlaces((data.source,))  # messages read there
    val = RLDataset.load(rl_files["val"], tokenizer, 64)  # validation read by place too, once a source
    assert batch_source.prompt_places(config, data, val) == PromptPlaces((data.source, val.source))
    assert batch_source.prompt_places(config, data, data) == PromptPlaces((data.source,))
    unread = RLDataset(data.samples)  # not built by RLDataset.load: no source to read from
    assert batch_source.prompt_places(config, unread) is None
    assert batch_source.prompt_places(config, data, RLDataset(val.samples)) == PromptPlaces((data.source,))


def test_image_prompts_by_place_read_their_images_on_the_replica(vlm_files):  # noqa: F811
    """Every row of the tiny VLM's shapes data: the replica reads the row's ids and processes its
    images with its own processor, to the controller's collated ids and ``ImageInputs``."""
    data_config = vlm_config(vlm_files, "unused").data
    model = vlm_files["model"]
    dataset = RLDataset.load(
        data_config.train_path, load_tokenizer(model), 128, images=image_reader(model, data_config)
    )
    indices = list(range(len(dataset)))
    by_ids = group_requests(dataset.collate(indices), 0, SHAPE, episodes=False)
    by_place = group_requests(dataset.requests(indices), 0, SHAPE, episodes=False)
    assert all(g.images is None and g.prompt_ids == () for g in by_place)  # nothing but the place
    places = pickle.loads(pickle.dumps(PromptPlaces((dataset.source,))))
    read = read_prompts(by_place, places.reader(load_tokenizer(model), model), replica=0)
    for got, expected in zip(read, by_ids, strict=True):
        assert got.prompt_ids == expected.prompt_ids
        assert torch.equal(got.images.pixel_values, expected.images.pixel_values)
        assert torch.equal(got.images.image_grid_thw, expected.images.image_grid_thw)
    assert len(pickle.dumps(by_place)) * 100 < len(pickle.dumps(by_ids))  # the pixels stay behind


@pytest.mark.slow  # two 2-step fully-async runs with a replica process each
def test_fully_async_by_place_trains_like_the_groups_carrying_ids(rl_files, tmp_path, monkeypatch):
    sent = []
    submit = fleet.RolloutFleet.submit

    def counted(self, requests):
        sent.append(len(pickle.dumps(requests)))
        return submit(self, requests)

    monkeypatch.setattr(fleet.RolloutFleet, "submit", counted)

    def run(out):
        config = small_config(
            rl_files, out, "data.val_path=", "pipeline.mode=fully_async", "pipeline.staleness_threshold=0",
            "pipeline.partial_rollout=false", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
        )  # fmt: skip
        sent.clear()
        return RLTrainer(config).fit().history, sum(sent)

    by_place, place_bytes = run(tmp_path / "places")
    monkeypatch.setattr(batch_source, "prompt_places", lambda *_: None)
    by_ids, ids_bytes = run(tmp_path / "ids")

    def comparable(history):  # the peak bytes waiting follow the replica's timing
        return [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in history]

    assert_same_histories(comparable(by_ids), comparable(by_place), relative=0.0)
    assert place_bytes < ids_bytes
    print(f"prompt group bytes sent to the replicas: by place {place_bytes}, with ids {ids_bytes}")
