"""Prompt groups on a replica: what the tracker stores equals what the engine generates directly."""

import dataclasses
import time

import pytest
import torch

from tandem.agents.config import AgentConfig
from tandem.agents.loops import AgentSample, run_episodes
from tandem.agents.rollout import AgentRollout
from tandem.models import load_tokenizer, save_tiny_model
from tandem.pipeline.groups import EpisodePrompt, GroupRequest, GroupTracker
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


def _engine(model_dir, max_model_len=64):
    return NativeRolloutEngine.from_pretrained(model_dir, NativeEngineConfig(max_model_len=max_model_len))


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


INTERACTION = """
def respond(messages, extra_info):
    if sum(m["role"] == "assistant" for m in messages) >= 2:
        return {"content": None, "done": True}
    return {"content": "once more, " + extra_info["who"], "done": False}
"""


def test_agent_groups_store_what_the_episodes_give_on_a_fresh_engine(model_dir, tmp_path):
    """Two-turn interaction episodes on the tracker: tokens, log-probs, masks, prompts and the
    conversations equal the same episodes (same seeds) run directly on a fresh engine."""
    (tmp_path / "interaction.py").write_text(INTERACTION)
    config = AgentConfig(name="interaction", interaction_path=str(tmp_path / "interaction.py"), max_turns=3)
    tokenizer = load_tokenizer(model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=64, stop=tuple("aeiou0123456789 "))  # short turns
    groups = [
        GroupRequest(
            f"u{g}", g, (), tuple(50 * g + i for i in range(2)), params,
            EpisodePrompt(({"role": "user", "content": f"hello {g}"},), {"who": f"w{g}"}),
        )
        for g in range(3)
    ]  # fmt: skip
    engine = _engine(model_dir, 256)
    agents = AgentRollout(config, tokenizer, engine)
    tracker = GroupTracker(replica=0, writer=InlineWriter(), agents=agents)
    tracker.start(engine, groups)
    metas = {m.uid: m for m in _collect_all(tracker, len(groups))}
    agents.close()
    engine.close()

    reference = _engine(model_dir, 256)
    ctx = AgentRollout(config, tokenizer, reference).context(params)
    for group in groups:
        samples = [
            AgentSample(
                list(group.episode.messages), seed, f"{group.uid}/{i}", dict(group.episode.extra_info)
            )
            for i, seed in enumerate(group.seeds)
        ]
        expected = run_episodes(ctx, samples)
        meta = metas[group.uid]
        fields = read_fields(meta.ref)
        assert fields["lengths"].tolist() == [len(t.token_ids) for t in expected]
        assert fields["token_ids"].tolist() == [x for t in expected for x in t.token_ids]
        assert fields["token_mask"].tolist() == [m for t in expected for m in t.loss_mask]
        assert fields["prompt_ids"].tolist() == [p for t in expected for p in t.prompt_ids]
        torch.testing.assert_close(
            fields["log_probs"], torch.tensor([p for t in expected for p in t.log_probs]), rtol=0, atol=1e-5
        )
        assert [e.messages for e in meta.episodes] == [t.messages for t in expected]
        assert [e.turns for e in meta.episodes] == [t.turns for t in expected]
        assert 0 in fields["token_mask"].tolist()  # the user's turns are in the tokens, masked out
        assert meta.min_version == meta.max_version == 0  # tool/user tokens (version -1) do not count
    reference.close()


def test_groups_that_find_no_room_wait_in_order_and_store_what_an_unbounded_collect_stores(
    model_dir, tmp_path
):
    """Backpressure on the replica: with room for two groups, two are stored and the rest wait
    (in finish order, counted as waiting time); later calls with room store them. The stored
    groups equal an unbounded tracker's, field for field."""
    groups = [
        GroupRequest(f"u{g}", g, (5 + g, 9, 11), tuple(10 * g + i for i in range(2)), PARAMS)
        for g in range(4)
    ]

    def finished_tracker(directory):
        engine = _engine(model_dir)
        tracker = GroupTracker(replica=0, writer=SampleWriter(str(directory)))
        tracker.start(engine, groups)
        while tracker.in_flight:
            time.sleep(0.01)
        engine.close()
        return tracker

    (tmp_path / "free").mkdir()
    (tmp_path / "bounded").mkdir()
    unbounded = {m.uid: read_fields(m.ref) for m in finished_tracker(tmp_path / "free").collect(0.0)}
    tracker = finished_tracker(tmp_path / "bounded")
    sizes = {uid: tracker.writer.size_of(fields) for uid, fields in unbounded.items()}
    order = [p.request.uid for p in tracker._finished]  # the order they finished in
    room = sizes[order[0]] + sizes[order[1]]
    first = tracker.collect(0.0, room=room)
    assert [m.uid for m in first] == order[:2] and tracker.waiting == 2
    assert len(list((tmp_path / "bounded").iterdir())) == 2  # the waiting ones are not in the store
    assert tracker.collect(0.0, room=0) == [] and tracker.waiting == 2
    time.sleep(0.05)
    oversized = tracker.collect(0.0, room=1, at_least_one=True)  # nothing queued: one gets through
    assert [m.uid for m in oversized] == order[2:3]
    last = tracker.collect(0.0, room=None)
    assert [m.uid for m in last] == order[3:] and tracker.waiting == 0
    assert tracker.waited_seconds() >= 2 * 0.05  # two groups waited at least the sleep
    for meta in first + oversized + last:
        stored = read_fields(meta.ref)
        assert stored.keys() == unbounded[meta.uid].keys()
        for name, tensor in stored.items():  # log-probs: the engines batched the groups differently
            atol = 1e-5 if name == "log_probs" else 0
            torch.testing.assert_close(tensor, unbounded[meta.uid][name], rtol=0, atol=atol)
