"""Prompt groups on a replica: what the tracker stores equals what the engine generates directly."""

import dataclasses

import pytest
import torch

from tandem.models import save_tiny_model
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.sample_store import (
    InlineSample,
    InlineWriter,
    SampleRef,
    SampleWriter,
    read_fields,
    release,
)
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine

PARAMS = SamplingParams(temperature=1.0, max_tokens=12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("groups") / "model"))


def _engine(model_dir):
    return NativeRolloutEngine.from_pretrained(model_dir, NativeEngineConfig(max_model_len=64))


def _collect_all(tracker, expected):
    metas = []
    for _ in range(400):
        metas += tracker.collect(wait_s=0.05)
        if len(metas) == expected:
            return metas
    raise AssertionError(f"only {len(metas)} of {expected} groups finished")


@pytest.mark.parametrize("store", ["shared_memory", "inline"])
def test_stored_groups_equal_a_direct_generation_with_the_same_seeds(model_dir, tmp_path, store):
    """In shared memory, and inline (a replica on another host sends the tensors with the metadata)."""
    groups = [
        GroupRequest(f"u{g}", g, (5 + g, 9, 11, 3), tuple(100 * g + i for i in range(3)), PARAMS)
        for g in range(4)
    ]
    engine = _engine(model_dir)
    writer = SampleWriter(str(tmp_path)) if store == "shared_memory" else InlineWriter()
    tracker = GroupTracker(replica=2, writer=writer)
    tracker.start(engine, groups)
    metas = {m.uid: m for m in _collect_all(tracker, len(groups))}
    engine.close()

    reference = _engine(model_dir)  # a fresh engine, one plain batch
    for group in groups:
        requests = [
            RolloutRequest(f"{group.uid}/{i}", group.prompt_ids, dataclasses.replace(PARAMS, seed=s))
            for i, s in enumerate(group.seeds)
        ]
        expected = reference.generate_batch(requests)
        meta = metas[group.uid]
        fields = read_fields(meta.ref)
        assert meta.replica == 2 and meta.index == group.index
        assert fields["lengths"].tolist() == [len(c.token_ids) for c in expected]
        assert fields["token_ids"].tolist() == [t for c in expected for t in c.token_ids]
        torch.testing.assert_close(
            fields["log_probs"], torch.tensor([p for c in expected for p in c.log_probs]), rtol=0, atol=1e-5
        )
        assert set(fields["versions"].tolist()) == {0} and meta.min_version == meta.max_version == 0
        assert meta.finish_reasons == tuple(c.finish_reason for c in expected)
        assert isinstance(meta.ref, SampleRef if store == "shared_memory" else InlineSample)
        release(meta.ref)
    assert not list(tmp_path.iterdir())  # files released; inline entries never made one
    reference.close()
    assert tracker.in_flight == 0 and tracker.idle_seconds() >= 0


def test_aborted_groups_are_left_out_and_duplicates_refused(model_dir, tmp_path):
    engine = _engine(model_dir)
    engine.pause("keep")  # nothing generates until resumed: the group is surely in flight
    tracker = GroupTracker(replica=0, writer=SampleWriter(str(tmp_path)))
    group = GroupRequest("a", 0, (5, 6), (1, 2), SamplingParams(max_tokens=8))
    tracker.start(engine, [group])
    with pytest.raises(ValueError, match="already in flight"):
        tracker.start(engine, [group])
    assert tracker.abort_all(engine) == 1
    engine.resume()
    assert tracker.collect(wait_s=1.0) == [] and tracker.in_flight == 0
    engine.close()
