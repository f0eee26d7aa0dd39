"""Agent groups kept in a rollout replica's data-plane blocks (``dataplane.enabled``, the
asynchronous modes): the rows a replica builds from its episodes (each its own prompt, the tool
and user turns masked out of ``response_mask``, weight version -1 there, a split episode's
positions restarting per segment) and the controller assembles by reference equal, bit for bit,
the batch the controller's ``assemble_batch`` builds from the same groups' sample files; the
conversations travel inline in the groups' metadata, and no decoded text is stored for them."""

import pytest
import torch

from tandem.agents.trajectory import Trajectory
from tandem.dataplane import DataPlaneConfig, get
from tandem.models import load_tokenizer
from tandem.pipeline.group_blocks import GroupBlockWriter
from tandem.pipeline.groups import EpisodePrompt, GroupRequest, GroupTracker, _Pending
from tandem.pipeline.runner import assemble_batch, assemble_stored
from tandem.pipeline.sample_queue import EpisodeInfo, GroupMeta
from tandem.pipeline.sample_store import SampleWriter, release
from tandem.pipeline.stored_rollout import RESPONSE_TEXT
from tandem.protocol.generation import Completion
from tandem.rl.data import RLDataset
from tandem.rollout import SamplingParams

MAX_TOKENS = 16
PARAMS = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)


def _episode(prompt: list[int], turns: list[tuple[str, list[int]]], version: int) -> Trajectory:
    """A trajectory of ``turns`` (``("model", ids)``: sampled at weights ``version``; ``("other",
    ids)``: a tool or user turn; ``("segment", ids)``: a later segment's prompt, where it starts)."""
    episode = Trajectory(tuple(prompt), messages=[{"role": "user", "content": str(prompt)}])
    for kind, ids in turns:
        if kind == "model":
            log_probs = [-0.1 * (k + 1) for k in range(len(ids))]
            episode.add_model_turn(Completion("r", (), ids, log_probs, [version] * len(ids), "stop"))
        else:
            if kind == "segment":
                episode.segment_starts.append(len(episode.token_ids))
            episode.add_other_turn(ids)
    episode.finish_reason = "stop"
    return episode


def _groups(dataset, split: bool):
    """Two agent groups of two episodes: prompts of different lengths (tools' schemas rendered in),
    tool turns between the model's, one split episode (``split``), responses of different lengths."""
    later = "segment" if split else "other"
    long_prompt = list(dataset.samples[1].prompt_ids) + [7, 8, 9]
    return [
        (0, [
            _episode(list(dataset.samples[0].prompt_ids), [("model", [5, 6]), ("other", [11, 12, 13]), ("model", [9])], 0),
            _episode(long_prompt, [("model", [4]), (later, [3, 3, 2]), ("model", [8, 8, 8, 1])], 1),
        ]),
        (2, [
            _episode(list(dataset.samples[2].prompt_ids), [("model", [2, 2, 2, 2, 2, 2])], 1),
            _episode(list(dataset.samples[2].prompt_ids), [("model", [1]), ("other", [6]), ("model", [3])], 0),
        ]),
    ]  # fmt: skip


def _meta(uid: str, index: int, episodes: list[Trajectory], ref) -> GroupMeta:
    infos = tuple(EpisodeInfo(t.messages, t.turns, t.tool_calls, t.tool_errors, 0.5) for t in episodes)
    return GroupMeta(
        uid=uid, index=index, replica=0, ref=ref, min_version=0, max_version=1,
        finish_reasons=tuple(t.finish_reason for t in episodes), seconds=0.0, episodes=infos,
        seeds=(0, 1), request_ids=(f"{uid}-0", f"{uid}-1"),
    )  # fmt: skip


def _packed(tracker: GroupTracker, uid: str, index: int, episodes: list[Trajectory]) -> dict:
    """The group's tensors as a replica's tracker packs them for its writer."""
    request = GroupRequest(uid, index, (), (0, 1), PARAMS, episode=EpisodePrompt(({"role": "user"},), {}))
    return tracker._pack(_Pending(request, 0.0), episodes)


@pytest.fixture(scope="module")
def prompts(rl_files):
    tokenizer = load_tokenizer(rl_files["model"])
    return tokenizer, RLDataset.load(rl_files["train"], tokenizer, 64)


@pytest.mark.parametrize("split", [False, True])
def test_stored_agent_groups_assemble_to_the_controllers_batch_bit_for_bit(prompts, tmp_path, split):
    """Bit for bit, but for one thing a draw with a split episode has: the controller zeroes the
    other rows' positions on their padding too (never attended), the blocks only the split row's."""
    tokenizer, dataset = prompts
    (tmp_path / "samples").mkdir()
    (tmp_path / "blocks").mkdir()
    width = max(len(s.prompt_ids) for s in dataset.samples) + 8  # room for the tools' schemas
    config = DataPlaneConfig(directory=str(tmp_path / "blocks"))
    blocks = GroupBlockWriter(config, width, MAX_TOKENS, tokenizer.pad_token_id, tokenizer)
    files = SampleWriter(str(tmp_path / "samples"))
    today, stored = [], []
    for g, (index, episodes) in enumerate(_groups(dataset, split)):
        uid = f"g{g}"
        today.append(
            _meta(
                uid, index, episodes, files.write(uid, _packed(GroupTracker(0, files), uid, index, episodes))
            )
        )
        stored.append(
            _meta(
                uid,
                index,
                episodes,
                blocks.write(uid, _packed(GroupTracker(0, blocks), uid, index, episodes)),
            )
        )

    ref = assemble_stored(stored, dataset, 2)
    got = ref.materialise(get)
    expected = assemble_batch(today, dataset, 2, tokenizer.pad_token_id)  # releases the sample files
    assert RESPONSE_TEXT not in got  # scored on their messages, which the metadata carries
    assert not {"agent_messages", "agent_turns"} & set(ref.stored_fields())
    attended = expected["attention_mask"].bool()
    for name, value in expected.tensors.items():
        if name == "position_ids" and split:
            value, got_value = value[attended], got[name][attended]
        else:
            got_value = got[name]
        assert got[name].dtype == value.dtype and torch.equal(got_value, value), name
    for name, value in expected.non_tensors.items():
        if name != "prompt_ids":
            assert list(got[name]) == list(value), name
    assert expected["response_mask"][0].tolist()[:6] == [1, 1, 0, 0, 0, 1]  # tool turns are not trained
    restart = expected["position_ids"][1, expected["prompts"].shape[1] + 1]  # the second segment's start
    assert (int(restart) == 0) == split
    # plain positions are derived on the reader, not stored; a split episode's are stored
    derived = [{c.name: bool(c.sources) for c in block.columns}["position_ids"] for block in ref.blocks()]
    assert derived == [not split, True]  # the second group has no split episode
    for meta in stored:
        release(meta.ref)
    assert not list((tmp_path / "blocks").iterdir()) and not list((tmp_path / "samples").iterdir())


def test_an_agent_prompt_wider_than_the_stored_rows_names_the_setting(prompts, tmp_path):
    tokenizer, dataset = prompts
    (tmp_path / "blocks").mkdir()
    index, episodes = _groups(dataset, True)[0]
    narrow = len(episodes[1].prompt_ids) - 1
    config = DataPlaneConfig(directory=str(tmp_path / "blocks"))
    writer = GroupBlockWriter(config, narrow, MAX_TOKENS, tokenizer.pad_token_id, tokenizer)
    with pytest.raises(ValueError, match="data.max_prompt_length"):
        writer.size_of(_packed(GroupTracker(0, writer), "g", index, episodes))
    assert not list((tmp_path / "blocks").iterdir())
