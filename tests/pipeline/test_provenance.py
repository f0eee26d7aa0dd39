"""Every asynchronous training row names where it came from (replica, restart generation, seed,
request id), and its seed is the one it was sampled with: resampling its prompt with that seed on
the same weights gives its tokens again (the reference). The end-to-end run is the slow sibling."""

import dataclasses
import time

import pytest

from tandem.models import load_tokenizer
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.provenance import (
    REPLICA,
    REPLICA_GENERATION,
    REQUEST_ID,
    SEED,
    provenance_columns,
)
from tandem.pipeline.runner import assemble_batch
from tandem.pipeline.sample_store import SampleWriter
from tandem.protocol.sequences import response_lengths
from tandem.rl import RLTrainer
from tandem.rl.data import RLDataset
from tandem.rl.derived import replica_plan
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.factory import build_rollout_engine
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine
from tests.rl.conftest import small_config

N = 3
PARAMS = SamplingParams(temperature=1.0, max_tokens=6)


def _responses(batch) -> list[list[int]]:
    """Each row's sampled response tokens (``responses [B, R]`` cut to its length)."""
    lengths = response_lengths(batch).tolist()
    return [row[:n].tolist() for row, n in zip(batch["responses"], lengths, strict=True)]


def _resampled(engine, batch, rows, params) -> list[list[int]]:
    """The responses ``engine`` samples for ``rows`` of ``batch``: each row's prompt, alone, with
    its recorded seed."""
    requests = [
        RolloutRequest(
            f"again-{i}", tuple(batch["prompt_ids"][i]), dataclasses.replace(params, seed=batch[SEED][i])
        )
        for i in rows
    ]
    return [list(c.token_ids) for c in engine.generate_batch(requests)]


def test_assembled_rows_name_their_replica_seed_and_request_and_the_seed_resamples_them(rl_files, tmp_path):
    tokenizer = load_tokenizer(rl_files["model"])
    dataset = RLDataset.load(rl_files["train"], tokenizer, 64)
    groups = [
        GroupRequest(
            f"g{g}", i, tuple(dataset.samples[i].prompt_ids), tuple(100 * g + 7 * k for k in range(N)), PARAMS
        )
        for g, i in enumerate([4, 1])
    ]
    engine = NativeRolloutEngine.from_pretrained(rl_files["model"], NativeEngineConfig(max_model_len=128))
    tracker = GroupTracker(replica=1, writer=SampleWriter(str(tmp_path)))
    tracker.start(engine, groups)  # the two groups' six requests decode together
    while tracker.in_flight:
        time.sleep(0.01)
    metas = {m.uid: m for m in tracker.collect(0.0)}
    stamped = [dataclasses.replace(metas["g0"], generation=2), metas["g1"]]  # as a restarted driver stamps
    batch = assemble_batch(stamped, dataset, N, tokenizer.pad_token_id)

    assert list(batch[REPLICA]) == [1] * 2 * N
    assert list(batch[REPLICA_GENERATION]) == [2] * N + [0] * N
    assert list(batch[SEED]) == [*groups[0].seeds, *groups[1].seeds]
    assert list(batch[REQUEST_ID]) == [f"g{g}/{k}" for g in range(2) for k in range(N)]
    assert list(batch["uid"]) == [r.split("/")[0] for r in batch[REQUEST_ID]]
    # the reference: each row's prompt alone, with its seed, on the same weights
    assert _resampled(engine, batch, range(len(batch)), PARAMS) == _responses(batch)
    engine.close()


def test_provenance_columns_refuse_a_group_whose_seeds_do_not_match_its_responses(rl_files, tmp_path):
    tokenizer = load_tokenizer(rl_files["model"])
    dataset = RLDataset.load(rl_files["train"], tokenizer, 64)
    group = GroupRequest("g0", 0, tuple(dataset.samples[0].prompt_ids), (1, 2), PARAMS)
    engine = NativeRolloutEngine.from_pretrained(rl_files["model"], NativeEngineConfig(max_model_len=128))
    tracker = GroupTracker(replica=0, writer=SampleWriter(str(tmp_path)))
    tracker.start(engine, [group])
    while tracker.in_flight:
        time.sleep(0.01)
    (meta,) = tracker.collect(0.0)
    engine.close()
    with pytest.raises(ValueError, match="'g0' reports 1 seed"):
        provenance_columns([dataclasses.replace(meta, seeds=(1,))])


class RowRecordingTrainer(RLTrainer):
    """Keeps each trained batch (the rows the step's advantages are computed on)."""

    def compute_advantages(self, batch):
        self.trained = [*getattr(self, "trained", []), (self.step, batch)]
        return super().compute_advantages(batch)


@pytest.mark.slow  # a 3-step one-step-off run with a replica process (the fast sibling is above)
def test_a_one_step_off_runs_trained_rows_name_their_origin_and_their_seeds_resample_them(rl_files, tmp_path):
    """Steps 1 and 2 of one-step-off train on rows sampled under the initial weights (version 0):
    a fresh engine of the replicas' kind on the model's own weights resamples each of those rows'
    tokens from its prompt and recorded seed."""
    config = small_config(
        rl_files, tmp_path, "pipeline.mode=one_step_off", "trainer.total_steps=3", "data.val_path=",
        "trainer.val_before_train=false", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
    )  # fmt: skip
    trainer = RowRecordingTrainer(config)
    trainer.fit()
    assert [step for step, _ in trainer.trained] == [1, 2, 3]
    plan = replica_plan(config)
    engine = build_rollout_engine(plan.engine.on_device("cpu"), config.model_path)
    seen_requests = set()
    for step, batch in trainer.trained:
        n = config.rollout.n
        assert list(batch[REPLICA]) == [0] * len(batch) and list(batch[REPLICA_GENERATION]) == [0] * len(
            batch
        )
        assert list(batch[REQUEST_ID]) == [f"{uid}/{k % n}" for k, uid in enumerate(batch["uid"])]
        assert not seen_requests & set(batch[REQUEST_ID])  # every trained row is its own request
        seen_requests |= set(batch[REQUEST_ID])
        versions = batch["weight_version"][batch["response_mask"].bool()]
        if step <= 2:
            assert int(versions.max()) == 0  # sampled under the initial weights
            assert _resampled(engine, batch, range(len(batch)), plan.shape.sampling) == _responses(batch)
    engine.close()
