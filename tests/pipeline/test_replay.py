"""``pipeline.replay``: a recorded asynchronous run's batches built again from its schedule record and
the replicas' sample log. The fast tier checks the replay source against ``assemble_batch`` of the
same groups (bit for bit) and the settings; the slow tier replays a whole fully-async run and gets
its metrics bit for bit."""

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from tandem.models import load_tokenizer
from tandem.pipeline.config import PipelineConfig
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.replay import ReplaySource, check_replayed_settings, staleness_metrics
from tandem.pipeline.runner import assemble_batch
from tandem.pipeline.sample_log import SampleLog, log_directory
from tandem.pipeline.sample_store import SampleWriter
from tandem.pipeline.schedule_record import ScheduleRecord, read_record
from tandem.pipeline.stored_rollout import version_span
from tandem.rl import RLTrainer
from tandem.rl.batch_source import check_replayable, replayed_settings
from tandem.rl.data import RLDataset
from tandem.rollout import SamplingParams
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine
from tandem.run.sampler import EpochSampler
from tests.rl.conftest import small_config

N = 3
PARAMS = SamplingParams(temperature=1.0, max_tokens=6)
SETTINGS = {"rollout.n": N, "data.train_batch_size": 4, "algorithm.adv_estimator": "grpo"}


@pytest.fixture(scope="module")
def prompts(rl_files):
    tokenizer = load_tokenizer(rl_files["model"])
    return tokenizer, RLDataset.load(rl_files["train"], tokenizer, 64)


def _replica_groups(rl_files, dataset, samples_dir, log_dir, rows):
    """Groups of ``rows``' prompts generated on a fresh engine by a replica's tracker that stores
    sample files and keeps a sample log, as a replica does with ``pipeline.record_schedule``; their
    metadata by uid."""
    engine = NativeRolloutEngine.from_pretrained(rl_files["model"], NativeEngineConfig(max_model_len=128))
    tracker = GroupTracker(replica=0, writer=SampleWriter(samples_dir))
    tracker.sample_log = SampleLog(log_dir, 0)
    requests = [
        GroupRequest(
            f"g{g}", i, tuple(dataset.samples[i].prompt_ids), tuple(10 * g + k for k in range(N)), PARAMS
        )
        for g, i in enumerate(rows)
    ]
    tracker.start(engine, requests)
    while tracker.in_flight:
        time.sleep(0.01)
    engine.close()
    return {meta.uid: meta for meta in tracker.collect(0.0)}


def test_the_replay_source_builds_each_recorded_draw_as_assemble_batch_does(rl_files, prompts, tmp_path):
    """A replica's groups, recorded for step 1 in an order of their own, replayed: the batch equals
    ``assemble_batch`` of the same groups (the controller's build from the sample files) field for
    field, dtype and bits; its staleness metrics are the recorded draw's; after the update the
    sampler holds the recorded state; a draw the record lacks is an error naming it."""
    tokenizer, dataset = prompts
    record_path = str(tmp_path / "schedule.jsonl")
    (tmp_path / "samples").mkdir()
    metas = _replica_groups(
        rl_files, dataset, str(tmp_path / "samples"), log_directory(record_path), [5, 0, 9, 2]
    )
    assert all(meta.sample_log for meta in metas.values())  # each reported group names its entry
    trained = [metas[uid] for uid in ("g2", "g0", "g3", "g1")]  # the order the queue handed them out
    trained[1] = dataclasses.replace(trained[1], generation=1, max_version=1)  # provenance travels
    record = ScheduleRecord(record_path)
    record.write_run(SETTINGS)
    record.write(1, 1, 0, trained)
    recorded_sampler = {"epoch": 2, "cursor": 3, "seed": 7, "size": len(dataset)}
    record.write_sampler(1, recorded_sampler)

    sampler = EpochSampler(len(dataset), seed=7)
    source = ReplaySource(record_path, dataset, sampler, N, tokenizer.pad_token_id, SETTINGS)
    source.start(0)
    got, metrics = source.next_batch(1, 1)
    expected = assemble_batch(trained, dataset, N, tokenizer.pad_token_id)  # reads the sample files
    assert set(got.keys()) == set(expected.keys())
    for name, value in expected.tensors.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    for name, value in expected.non_tensors.items():
        assert list(got[name]) == list(value), name
    assert list(got["replica_generation"][N : 2 * N]) == [1] * N
    oldest, newest = version_span(expected["weight_version"], expected["response_mask"])
    assert metrics == staleness_metrics(oldest, newest, 0)
    assert source.after_update(1) == {} and sampler.state() == recorded_sampler
    with pytest.raises(ValueError, match=r"has no draw 2 of step 1 .*trainer.total_steps"):
        source.next_batch(1, 2)


def test_the_replayed_settings_must_be_the_recorded_runs(rl_files, tmp_path):
    """A setting that differs is an error naming its key and both values; a record without a run
    line is refused; the settings hold the batch shape, seed, mode, model and every algorithm key."""
    record = str(tmp_path / "schedule.jsonl")
    ScheduleRecord(record).write_run(SETTINGS)
    check_replayed_settings(record, read_record(record).runs, dict(SETTINGS))
    with pytest.raises(
        ValueError,
        match=r"data.train_batch_size=8, but the run recorded in pipeline.replay=.* had data.train_batch_size=4",
    ):
        check_replayed_settings(record, read_record(record).runs, {**SETTINGS, "data.train_batch_size": 8})
    with pytest.raises(ValueError, match=r"algorithm.kl.coef=0.5, but .* had algorithm.kl.coef=None"):
        check_replayed_settings(record, read_record(record).runs, {**SETTINGS, "algorithm.kl.coef": 0.5})
    with pytest.raises(ValueError, match="holds no run line"):
        check_replayed_settings(record, [], SETTINGS)
    with pytest.raises(ValueError, match=r"its sample log .*schedule.jsonl.samples is missing"):
        ReplaySource(record, None, None, N, 0, SETTINGS)

    config = small_config(rl_files, tmp_path, "pipeline.mode=fully_async", "trainer.seed=5")
    settings = replayed_settings(config)
    assert {"model_path", "data.train_batch_size", "rollout.n", "trainer.seed", "pipeline.mode",
            "algorithm.adv_estimator", "algorithm.kl.coef"} <= set(settings)  # fmt: skip
    assert settings["trainer.seed"] == 5 and settings["pipeline.mode"] == "fully_async"


def test_the_setting_names_an_existing_record_of_an_asynchronous_run(rl_files, tmp_path):
    record = tmp_path / "schedule.jsonl"
    with pytest.raises(ValueError, match=r"pipeline.replay=.*schedule.jsonl: no such file"):
        PipelineConfig(mode="fully_async", replay=str(record))
    record.write_text("")
    assert PipelineConfig(mode="fully_async", replay=str(record)).replay == str(record)
    with pytest.raises(ValueError, match=r"pipeline.replay replays an asynchronous run.*not sync"):
        PipelineConfig(replay=str(record))
    with pytest.raises(ValueError, match="set only one of them"):
        PipelineConfig(mode="fully_async", replay=str(record), record_schedule=str(tmp_path / "again.jsonl"))
    config = small_config(rl_files, tmp_path, "pipeline.mode=fully_async", f"pipeline.replay={record}")
    with pytest.raises(ValueError, match=r"validation generates: set data.val_path="):
        check_replayable(config)
    check_replayable(small_config(rl_files, tmp_path, "pipeline.mode=fully_async", "data.val_path="))


TWO_CORES = ("pipeline.trainer_threads=1", "pipeline.rollout_threads=1")


@pytest.mark.slow  # a 3-step asynchronous run with a replica process, then its replay (fast siblings above)
@pytest.mark.parametrize(
    "mode, dataplane", [("fully_async", "false"), ("fully_async", "true"), ("one_step_off", "false")]
)
def test_an_asynchronous_run_replayed_from_its_record_has_its_metrics_bit_for_bit(
    rl_files, tmp_path, mode, dataplane
):
    """A fully-async run (staleness 1, partial rollouts, so its batches hold stale rows), or a
    one-step-off one (each step trains the draw made during the step before), with
    ``pipeline.record_schedule``, then ``pipeline.replay`` of its record in a fresh output directory:
    every step's metrics equal the run's exactly, the ``pipeline/*`` metrics of replicas and queue
    aside (a replay has none; its staleness metrics are the run's), and so do the last checkpoint's
    weights and trainer state (the sampler's position included). With ``dataplane.enabled=true``
    the run's batches were the replicas' blocks (``assemble_stored``), the replay's the log's."""
    record = tmp_path / "recorded" / "schedule.jsonl"
    common = (f"pipeline.mode={mode}", "trainer.total_steps=3", "data.val_path=", *TWO_CORES,
              f"dataplane.enabled={dataplane}")  # fmt: skip
    run = RLTrainer(small_config(rl_files, tmp_path / "run", *common, f"pipeline.record_schedule={record}"))
    original = run.fit().history
    replayed = RLTrainer(small_config(rl_files, tmp_path / "replay", *common, f"pipeline.replay={record}"))
    again = replayed.fit().history

    kept = ("pipeline/staleness/", "pipeline/partial_samples")

    def comparable(history):
        return [
            {k: v for k, v in h.items()
             if (k.startswith(kept) or not k.startswith("pipeline/"))
             and not (k.startswith(("timing_s", "perf/")) or k.endswith(("_s", "_gbps")))}
            for h in history
        ]  # fmt: skip

    assert comparable(again) == comparable(original)  # exact: no tolerance
    assert len(original) == 3 and "actor/pg_loss" in original[0]
    assert max(h["pipeline/staleness/max"] for h in original) >= 1  # stale rows were replayed too
    step = Path("checkpoints") / "global_step_3"
    for part in ("trainer_state.json", "actor/dcp/__0_0.distcp"):
        assert (tmp_path / "run" / step / part).read_bytes() == (
            tmp_path / "replay" / step / part
        ).read_bytes()
    print("staleness per step:", [h["pipeline/staleness/mean"] for h in original],
          "partial rows:", [h["pipeline/partial_samples"] for h in original])  # fmt: skip
