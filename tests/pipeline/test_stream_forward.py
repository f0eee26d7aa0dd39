"""``pipeline.stream_forward``: the asynchronous modes' forward-only passes run on a draw's prompt
groups in chunks as they finish, and the step trains as it does without streaming.

The fast tests hold the pieces against their references: the sample queue's chunks are the groups
an unstreamed take returns, in order; the refusals name the keys. The slow ones run 3-step
pipelines streamed and not, with one replica generating one prompt group at a time
(``max_num_seqs`` = ``rollout.n``), so that groups finish one by one while the trainer waits.
"""

import multiprocessing
import os
import threading
import time

import pytest
import torch

from tandem.dataplane import BatchRef, ShmStore
from tandem.pipeline.sample_queue import GroupMeta, SampleQueue
from tandem.pipeline.sample_store import InlineSample
from tandem.protocol import Batch
from tandem.rl import step_data as step_data_module
from tandem.rl.stream_forward import ForwardStream
from tandem.rl.stream_plan import chunk_groups
from tests.pipeline.test_async_dataplane import MODES, TWO_CORES, ReplicaRecordingTrainer, _files_of
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import assert_draws_stay_stored

STREAM_METRICS = ("pipeline/streamed_rows", "pipeline/stream_forward_s")
ONE_GROUP_AT_A_TIME = ("rollout.engine.native.max_num_seqs=4",)  # rollout.n=4 in small_config


def _group(serial: int, version: int = 0) -> GroupMeta:
    return GroupMeta(f"g{serial}", serial, 0, InlineSample({}), version, version, ("length",), 0.0)


def test_the_queue_hands_over_each_full_chunk_during_the_wait_in_order():
    """Chunks handed over while the take waits are its own groups in order; the unfinished last
    chunk is left to the caller; a stale group is dropped, never handed over."""
    queue, chunks = SampleQueue(staleness_threshold=0), []
    arrivals = [[_group(0), _group(1, version=-1)], [_group(2)], [_group(3), _group(4)], [_group(5)]]

    def produce():
        for groups in arrivals:
            time.sleep(0.05)
            queue.put(groups)

    producer = threading.Thread(target=produce)
    producer.start()
    taken = queue.take(5, trainer_version=0, chunk=2, on_chunk=lambda groups: chunks.append(groups))
    producer.join()
    assert [g.uid for g in taken] == ["g0", "g2", "g3", "g4", "g5"]  # g1 too stale
    assert queue.dropped_stale == 1
    assert [[g.uid for g in chunk] for chunk in chunks] == [["g0", "g2"], ["g3", "g4"]]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (("dataplane.enabled=false",), "dataplane.enabled"),
        (("trainer.n_workers=2", "trainer.balance_batch=true"), "trainer.balance_batch"),
        (("algorithm.filter_groups.enable=true",), "algorithm.filter_groups.enable"),
        (("pipeline.old_log_probs=rollout", "algorithm.kl.use_kl_loss=false"), "no pass that streams"),
    ],
)
def test_plans_that_cannot_stream_are_refused_naming_the_keys(rl_files, tmp_path, overrides, named):
    with pytest.raises(ValueError, match="pipeline.stream_forward=true") as error:
        small_config(
            rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.stream_forward=true",
            "dataplane.enabled=true", *overrides,
        )  # fmt: skip
    assert named in str(error.value)


def test_the_sync_mode_is_refused(rl_files, tmp_path):
    with pytest.raises(ValueError, match="pipeline.mode=sync"):
        small_config(rl_files, tmp_path, "pipeline.stream_forward=true", "dataplane.enabled=true")


def test_the_automatic_chunk_is_one_micro_batch_per_actor_rank(rl_files, tmp_path):
    def groups(*overrides):
        config = small_config(
            rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.stream_forward=true",
            "dataplane.enabled=true", "data.train_batch_size=8", "trainer.balance_batch=false", *overrides,
        )  # fmt: skip
        return chunk_groups(config)

    padded = ("actor.engine.use_packing=false", "actor.engine.micro_batch_size")
    # padded: 2 ranks x 4 rows = 8 rows = 2 groups of 4
    assert groups(padded[0], f"{padded[1]}=4", "trainer.n_workers=2") == 2
    # 3 ranks x 1 row: 1 group of 4 rows, made 3 groups so that the rows divide over the 3 ranks
    assert groups(padded[0], f"{padded[1]}=1", "trainer.n_workers=3", "data.train_batch_size=6") == 3
    # packed: 140 tokens hold 2 of the longest (64 + 6) sequences, one rank: 2 rows, 1 group
    assert groups("actor.engine.max_tokens_per_micro_batch=140") == 1
    assert groups("pipeline.stream_forward_groups=3") == 3
    assert groups("pipeline.stream_forward_groups=50") == 8  # at most the step's groups


class _Ranks:
    """A worker group's stand-in for the trainer-side join (no engine): its ``compute_log_prob``
    reads the rows' ``responses`` from the store and keeps ``old_log_probs [B, R]`` there."""

    def __init__(self, store):
        self.store, self.released = store, []

    def compute_log_prob(self, ref):
        responses = ref.materialise(self.store.get, ["responses"])["responses"]
        return BatchRef.put(Batch({"old_log_probs": responses.float().sin()}), self.store)

    def release_refs(self, ref):
        self.released.append(ref)
        ref.release(self.store.release)


def _draw(store, rows=8, stored_width=6):
    """A stored draw at ``stored_width`` response columns, as a replica stores it, with its ids."""
    batch = Batch(
        {"responses": torch.arange(rows * stored_width).view(rows, stored_width)},
        {"uid": [f"g{r // 4}" for r in range(rows)], "request_id": [f"r{r}" for r in range(rows)]},
    )
    return BatchRef.put(batch, store)


def test_the_joined_chunk_outputs_are_the_whole_draws_output(tmp_path):
    """The passes' outputs over chunks at the stored width, joined and cropped, materialise to the
    pass over the draw cropped to its own width; rows that are not the chunks' are refused."""
    store = ShmStore(str(tmp_path))
    ranks, draw = _Ranks(store), _draw(store)
    step_draw = draw.crop({"responses": (0, 0, 4)})  # the draw trimmed to its longest response
    stream = ForwardStream(None, (lambda trainer, data, timings: data.stage(ranks, ranks.compute_log_prob),))
    for chunk in (draw[:4], draw[4:]):
        stream(chunk)
    outputs = stream.outputs_for(step_draw, {})
    joined = outputs["compute_log_prob"][1].materialise(store.get)["old_log_probs"]
    expected = ranks.compute_log_prob(step_draw).materialise(store.get)["old_log_probs"]
    assert torch.equal(joined, expected)
    for chunk in (draw[:4], draw[4:]):
        stream(chunk)
    with pytest.raises(RuntimeError, match="pipeline.stream_forward"):
        stream.outputs_for(step_draw.reorder([4, 5, 6, 7, 0, 1, 2, 3]), {})
    assert len(ranks.released) == 1  # the refused join's outputs, released


class StreamRecordingTrainer(ReplicaRecordingTrainer):
    """Also notes, per step, which passes' outputs came from the chunks (and were not run again)."""

    def train_step(self):
        self.taken_streamed = getattr(self, "taken_streamed", [])
        self.taken_streamed.append([])
        return super().train_step()


def _run(rl_files, out, monkeypatch, *overrides):
    stage = step_data_module.RefStep.stage
    trainer_box = []

    def recorded(self, group, method, joined=False):
        if trainer_box and method.__name__ in self.streamed:
            trainer_box[0].taken_streamed[-1].append(method.__name__)
        return stage(self, group, method, joined)

    monkeypatch.setattr(step_data_module.RefStep, "stage", recorded)
    config = small_config(
        rl_files, out, "data.val_path=", "trainer.total_steps=3", "dataplane.enabled=true",
        *TWO_CORES, *ONE_GROUP_AT_A_TIME, *overrides,
    )  # fmt: skip
    trainer = StreamRecordingTrainer(config)
    trainer_box.append(trainer)
    return trainer.fit().history, trainer


@pytest.mark.slow  # two 3-step pipeline runs per mode, with a replica process each
@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_passes_train_like_the_whole_draws(rl_files, tmp_path, monkeypatch, mode):
    kl = ("algorithm.kl.use_kl_loss=true",)  # a reference pass streams beside the old log-probs
    whole, _ = _run(rl_files, tmp_path / "whole", monkeypatch, *MODES[mode], *kl)
    streamed, trainer = _run(
        rl_files, tmp_path / "streamed", monkeypatch, *MODES[mode], *kl,
        "pipeline.stream_forward=true", "pipeline.stream_forward_groups=1",
    )  # fmt: skip

    def comparable(history):  # the byte metrics count blocks, which chunks do not change; idle differs
        return [
            {k: v for k, v in h.items() if k not in STREAM_METRICS and not k.startswith("pipeline/inflight")}
            for h in history
        ]

    # with packing (the default) a row's forward does not depend on the padding around it or on
    # the rows beside it: the runs agree bit for bit (2026-12-03), the shared helper's 1e-5 aside
    assert_same_histories(comparable(whole), comparable(streamed))
    rows = [h["pipeline/streamed_rows"] for h in streamed]
    both = ["compute_log_prob", "compute_ref_log_prob"]  # a step none of whose rows streamed runs them
    assert trainer.taken_streamed == [both if r else [] for r in rows]
    assert_draws_stay_stored(trainer)
    assert trainer.left == [[], [], []]  # the chunks' outputs released with the step
    assert not _files_of(trainer.replica_pids | {os.getpid()})
    assert not multiprocessing.active_children()
    if mode == "fully_async":  # the trainer waits for every step's groups: chunks ran before the last
        assert all(r > 0 for r in rows), rows
    print(f"{mode}: streamed rows {rows}; idle whole {[round(h['pipeline/trainer_idle_s'], 3) for h in whole]}, "
          f"streamed {[round(h['pipeline/trainer_idle_s'], 3) for h in streamed]}")  # fmt: skip
