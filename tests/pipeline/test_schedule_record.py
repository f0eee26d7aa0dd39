"""``pipeline.record_schedule``: every draw appends the prompt groups it holds, with where each came
from, before its step trains; a fully-async run's record lists exactly the uids each step's batch
held (the batches captured in the run are the reference)."""

import json
import os

import pytest

from tandem.config.paths import with_absolute_paths
from tandem.pipeline.config import PipelineConfig
from tandem.pipeline.sample_queue import GroupMeta
from tandem.pipeline.sample_store import InlineSample
from tandem.pipeline.schedule_record import ScheduleRecord, read_schedule
from tandem.rl import RLTrainer
from tests.rl.conftest import small_config


def _group(uid: str, replica: int, generation: int, seeds: tuple[int, ...]) -> GroupMeta:
    return GroupMeta(
        uid=uid,
        index=3,
        replica=replica,
        ref=InlineSample({}),
        min_version=1,
        max_version=2,
        finish_reasons=("stop",) * len(seeds),
        seconds=0.5,
        seeds=seeds,
        request_ids=tuple(f"{uid}/{k}" for k in range(len(seeds))),
        generation=generation,
    )


def test_each_draw_is_one_line_on_disk_when_written(tmp_path):
    path = tmp_path / "run" / "schedule.jsonl"  # its directory is made
    record = ScheduleRecord(str(path))
    record.write(1, 1, 0, [_group("g0", 0, 0, (5, 6)), _group("g1", 1, 2, (7, 8))])
    first = path.read_text()  # written through before write() returns: nothing held in a buffer
    assert json.loads(first) == {
        "step": 1,
        "draw": 1,
        "trainer_version": 0,
        "groups": [
            {"uid": "g0", "index": 3, "replica": 0, "replica_generation": 0, "min_version": 1, "max_version": 2,
             "seeds": [5, 6], "request_ids": ["g0/0", "g0/1"], "finish_reasons": ["stop", "stop"]},
            {"uid": "g1", "index": 3, "replica": 1, "replica_generation": 2, "min_version": 1, "max_version": 2,
             "seeds": [7, 8], "request_ids": ["g1/0", "g1/1"], "finish_reasons": ["stop", "stop"]},
        ],
    }  # fmt: skip
    ScheduleRecord(str(path)).write(2, 1, 1, [_group("g2", 0, 0, (9, 10))])  # a resumed run appends
    assert [(line["step"], [g["uid"] for g in line["groups"]]) for line in read_schedule(str(path))] == [
        (1, ["g0", "g1"]),
        (2, ["g2"]),
    ]


def test_a_line_cut_short_by_a_crash_is_left_out_and_a_broken_one_before_others_is_named(tmp_path):
    path = tmp_path / "schedule.jsonl"
    ScheduleRecord(str(path)).write(1, 1, 0, [_group("g0", 0, 0, (5,))])
    with path.open("a") as file:
        file.write('{"step": 2, "dr')  # the process died while writing step 2's line
    assert [line["step"] for line in read_schedule(str(path))] == [1]
    with path.open("a") as file:
        file.write("\n" + json.dumps({"step": 3}) + "\n")
    with pytest.raises(ValueError, match="schedule.jsonl, line 2"):
        read_schedule(str(path))


def test_the_setting_is_an_output_path_and_needs_an_asynchronous_mode(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = with_absolute_paths(PipelineConfig(mode="fully_async", record_schedule="out/schedule.jsonl"))
    assert config.record_schedule == os.path.join(str(tmp_path), "out", "schedule.jsonl")
    with pytest.raises(ValueError, match="pipeline.record_schedule .* pipeline.mode=sync"):
        PipelineConfig(record_schedule="schedule.jsonl")


class UidRecordingTrainer(RLTrainer):
    """Keeps each step's batch uids, in row order."""

    def compute_advantages(self, batch):
        self.uids = [*getattr(self, "uids", []), (self.step, list(batch["uid"]))]
        return super().compute_advantages(batch)


@pytest.mark.slow  # a 4-step fully-async run with two replica processes (the fast siblings are above)
def test_a_fully_async_runs_record_lists_the_uids_each_steps_batch_held(rl_files, tmp_path):
    record = tmp_path / "schedule.jsonl"
    config = small_config(
        rl_files, tmp_path, "pipeline.mode=fully_async", "pipeline.rollout_replicas=2", "trainer.total_steps=4",
        "data.val_path=", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
        f"pipeline.record_schedule={record}",
    )  # fmt: skip
    trainer = UidRecordingTrainer(config)
    trainer.fit()
    n = config.rollout.n
    lines = read_schedule(str(record))
    assert [(line["step"], line["draw"]) for line in lines] == [(s, 1) for s in range(1, 5)]
    recorded = [(line["step"], [g["uid"] for g in line["groups"] for _ in range(n)]) for line in lines]
    assert recorded == trainer.uids  # exactly the rows each step trained on, in order
    for line in lines:
        for group in line["groups"]:
            assert group["replica"] in (0, 1) and group["replica_generation"] == 0
            assert group["request_ids"] == [f"{group['uid']}/{k}" for k in range(n)]
            assert len(set(group["seeds"])) == n
            assert (
                0
                <= group["min_version"]
                <= group["max_version"]
                <= line["trainer_version"]
                == line["step"] - 1
            )
