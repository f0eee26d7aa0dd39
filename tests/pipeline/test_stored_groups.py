"""Asynchronous groups kept in the data plane (``dataplane.enabled``): a replica's blocks of
training rows, assembled by reference, equal the controller's ``assemble_batch`` of the same
groups bit for bit, and the byte bound counts the blocks' files."""

import dataclasses
import time

import pytest
import torch

from tandem.dataplane import DataPlaneConfig, get
from tandem.models import load_tokenizer
from tandem.pipeline.group_blocks import PROMPT_FIELD, GroupBlockWriter
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.runner import assemble_batch, assemble_stored
from tandem.pipeline.sample_store import SampleWriter, read_fields, release, stored_nbytes
from tandem.pipeline.stored_rollout import (
    LAST_SAMPLED,
    NEWEST_VERSION,
    OLDEST_VERSION,
    RESPONSE_TEXT,
    version_span,
)
from tandem.protocol.sequences import PROMPT_LENGTH, RESPONSE_LENGTH
from tandem.rl.data import RLDataset
from tandem.rl.step_data import rollout_stays_in_store
from tandem.rl.step_plan import build_step_plan
from tandem.rollout import SamplingParams
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine
from tests.rl.conftest import small_config

N = 3
PARAMS = SamplingParams(temperature=1.0, max_tokens=6)
INLINE = {PROMPT_LENGTH, RESPONSE_LENGTH, LAST_SAMPLED, RESPONSE_TEXT, OLDEST_VERSION, NEWEST_VERSION}


@pytest.fixture(scope="module")
def prompts(rl_files):
    tokenizer = load_tokenizer(rl_files["model"])
    return tokenizer, RLDataset.load(rl_files["train"], tokenizer, 64)


def _finished(rl_files, writer, groups):
    """A tracker that stores with ``writer``, once ``groups`` have finished on a fresh engine."""
    engine = NativeRolloutEngine.from_pretrained(rl_files["model"], NativeEngineConfig(max_model_len=128))
    tracker = GroupTracker(replica=0, writer=writer)
    tracker.start(engine, groups)
    while tracker.in_flight:
        time.sleep(0.01)
    engine.close()
    return tracker


def _generate(rl_files, writer, groups):
    """``groups``' metadata by uid, generated on a fresh engine and stored by ``writer``."""
    return {m.uid: m for m in _finished(rl_files, writer, groups).collect(0.0)}


def _block_writer(tmp_path, tokenizer, dataset):
    width = max(len(s.prompt_ids) for s in dataset.samples)
    config = DataPlaneConfig(directory=str(tmp_path / "blocks"))
    return GroupBlockWriter(config, width, PARAMS.max_tokens, tokenizer.pad_token_id, tokenizer)


def test_stored_groups_assemble_to_the_controllers_batch_bit_for_bit(rl_files, prompts, tmp_path):
    """The same generated groups, stored as sample files (today) and as the replica's blocks:
    ``assemble_stored(...)`` materialised equals ``assemble_batch(...)`` field for field (dtype,
    shape and values, the per-row version spans included), with no ``prompt_ids`` and the
    scalars the rewards and metrics read inline; each block's size is what the writer predicted
    for the byte bound; released, no file is left."""
    tokenizer, dataset = prompts
    (tmp_path / "samples").mkdir()
    (tmp_path / "blocks").mkdir()
    rows = [5, 0, 9, 2]  # prompts of different lengths: the crop to the batch's widths matters
    groups = [
        GroupRequest(
            f"g{g}", i, tuple(dataset.samples[i].prompt_ids), tuple(10 * g + k for k in range(N)), PARAMS
        )
        for g, i in enumerate(rows)
    ]
    metas = _generate(rl_files, SampleWriter(str(tmp_path / "samples")), groups)
    in_order = [metas[g.uid] for g in groups]
    writer = _block_writer(tmp_path, tokenizer, dataset)
    stored = []
    for group, meta in zip(groups, in_order, strict=True):
        fields = {**read_fields(meta.ref), PROMPT_FIELD: torch.tensor(group.prompt_ids)}
        ref = writer.write(meta.uid, fields)
        assert stored_nbytes(ref) == writer.size_of(fields)  # the bound's measure is the file's
        stored.append(dataclasses.replace(meta, ref=ref))

    assembled = assemble_stored(stored, dataset, N)
    got = assembled.materialise(get)
    expected = assemble_batch(in_order, dataset, N, tokenizer.pad_token_id)  # releases the sample files
    assert set(got.keys()) == (set(expected.keys()) - {"prompt_ids"}) | INLINE
    assert not set(assembled.stored_fields()) & INLINE  # scalars are inline, tokens stored
    for name, value in expected.tensors.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    for name, value in expected.non_tensors.items():
        if name != "prompt_ids":
            assert list(got[name]) == list(value), name
    oldest, newest = version_span(expected["weight_version"], expected["response_mask"])
    assert torch.equal(got[OLDEST_VERSION], oldest) and torch.equal(got[NEWEST_VERSION], newest)
    assert len(assembled.blocks()) == len(groups)

    for meta in stored:
        release(meta.ref)
    assert not list((tmp_path / "blocks").iterdir()) and not list((tmp_path / "samples").iterdir())


@pytest.mark.slow  # a second generation; the end-to-end runs cover this path too
def test_a_tracker_with_the_block_writer_stores_rows_within_its_room(rl_files, prompts, tmp_path):
    """On the replica: the tracker packs each group's prompt for the block writer, stores only the
    groups that fit the room it is given (measured in block bytes), and the rows it stores hold the
    tokens a sample-file tracker stores for the same seeds."""
    tokenizer, dataset = prompts
    (tmp_path / "samples").mkdir()
    (tmp_path / "blocks").mkdir()
    groups = [
        GroupRequest(
            f"g{g}", g, tuple(dataset.samples[g].prompt_ids), tuple(7 * g + k for k in range(N)), PARAMS
        )
        for g in range(3)
    ]
    reference = _generate(rl_files, SampleWriter(str(tmp_path / "samples")), groups)
    tracker = _finished(rl_files, _block_writer(tmp_path, tokenizer, dataset), groups)
    one = tracker.collect(0.0, room=1, at_least_one=True)  # room for none: only the first gets through
    assert len(one) == 1 and tracker.waiting == 2
    assert len(list((tmp_path / "blocks").iterdir())) == 1  # the waiting groups are not in the store
    rest = tracker.collect(0.0, room=None)
    assert tracker.waiting == 0
    for meta in one + rest:
        rows = meta.ref.materialise(get, ["responses", RESPONSE_LENGTH])
        fields = read_fields(reference[meta.uid].ref)
        tokens = [
            row[:n].tolist() for row, n in zip(rows["responses"], rows[RESPONSE_LENGTH].tolist(), strict=True)
        ]
        spans = fields["lengths"].cumsum(0).tolist()
        assert tokens == [
            fields["token_ids"][a:b].tolist() for a, b in zip([0, *spans[:-1]], spans, strict=True)
        ]
        release(meta.ref)
        release(reference[meta.uid].ref)
    assert not list((tmp_path / "blocks").iterdir())


@pytest.mark.parametrize(
    "overrides, stays",
    [
        (("pipeline.mode=one_step_off",), True),
        (("pipeline.mode=fully_async",), True),
        (("pipeline.mode=fully_async", "dataplane.enabled=false"), False),
        (("pipeline.mode=fully_async", "pipeline.old_log_probs=rollout"), True),  # an alias: BatchRef.alias
        (("pipeline.mode=one_step_off", "pipeline.sample_store=inline"), True),  # blocks replace the samples
        (("pipeline.mode=one_step_off", "trainer.backend=ray", "dataplane.engine=ray"), True),  # any node
        (("pipeline.mode=one_step_off", "agent.name=tool_agent", "agent.tools=[calculator]"), True),
        (("pipeline.mode=fully_async", "agent.name=program", "agent.program={program}"), True),
        (("pipeline.mode=sync", "agent.name=tool_agent", "agent.tools=[calculator]"), True),
        (("pipeline.mode=sync", "agent.name=program", "agent.program={program}"), True),  # a fixed width
    ],
)
def test_which_asynchronous_runs_keep_their_draws_in_the_replicas_blocks(
    rl_files, tmp_path, overrides, stays
):
    (tmp_path / "agent.py").write_text("async def run(client, row):\n    return {}\n")
    overrides = [o.format(program=tmp_path / "agent.py") for o in overrides]
    config = small_config(rl_files, tmp_path, "dataplane.enabled=true", *overrides)
    assert rollout_stays_in_store(config, False, build_step_plan(config)) is stays
