"""Online DPO (``preset=online_dpo``) with ``dataplane.enabled``: the pairs are references into the
stored draw (rows picked from the per-row scores, the pair columns inline), the reference's pass
and the update's ranks fetch their rows, and each update rank makes the ``loss_mask`` and the
reference's sums itself (:mod:`tandem.rl.preference_pairs`). The metrics equal the ``Batch``
path's bit for bit, step for step on a fixed seed; the controller fetches no stored field, each
update fetches exactly the wire bytes of its declared fields of its pairs' rows, every block is
released; with two spawned workers (slow) the controller serialises no payload in the update."""

import os
from collections import Counter

import pytest
import torch

from tandem.dataplane import BatchRef, ShmStore, get, traffic
from tandem.dataplane.shm import PREFIX
from tandem.protocol.traffic import batch_traffic
from tandem.rl import RLTrainer
from tandem.rl.preference_pairs import best_worst_pairs, best_worst_rows, stored_pairs, with_pair_fields
from tandem.rl.worker import ACTOR_UPDATE_FIELDS
from tests.dpo.test_online_dpo import scored_groups
from tests.rl.conftest import small_config
from tests.rl.test_dataplane_advantages import differences
from tests.rl.test_dataplane_step import assert_draws_stay_stored, block_files, reads_on_wire


class PairCountingTrainer(RLTrainer):
    """Records, per step: the draw the update stage got, the store bytes fetched in the step
    outside the workers' calls, what each update call fetched by field against its declared reads
    of its rows, the controller's batch bytes in the update stage, and block files left."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.draws, self.own_fetched, self.step_bytes, self.left = [], [], [], []
        self.update_by_field, self.update_expected = [], []
        self._in_calls = 0
        self._probed = Counter()

    def _wrap(self) -> None:
        workers = self.workers
        if getattr(workers, "pairs_counted", False):
            return
        workers.pairs_counted = True
        update, reference = workers.update_actor, workers.compute_ref_log_prob

        def counted_update(batch, **kwargs):
            if isinstance(batch, BatchRef):
                self.update_expected.append(reads_on_wire(batch, ACTOR_UPDATE_FIELDS, self._probed))
            start = traffic()
            out = update(batch, **kwargs)
            used = traffic() - start
            self._in_calls += used.fetched_bytes
            self.update_by_field.append(Counter(used.fetched_by_field))
            return out

        def counted_reference(batch):
            start = traffic().fetched_bytes
            out = reference(batch)
            self._in_calls += traffic().fetched_bytes - start
            return out

        workers.update_actor, workers.compute_ref_log_prob = counted_update, counted_reference

    def collect_batch(self, timings):
        batch, metrics = super().collect_batch(timings)
        self.draws.append(batch)
        self._after_draw = batch_traffic()  # the generation's request is a Batch; what follows, none
        return batch, metrics

    def train_step(self):
        self._wrap()
        self._in_calls, self._probed = 0, Counter()
        start = traffic().fetched_bytes
        metrics = super().train_step()
        self.step_bytes.append((batch_traffic() - self._after_draw).total)
        self.own_fetched.append(traffic().fetched_bytes - start - self._in_calls - self._probed.total())
        pids = {os.getpid(), *getattr(self.workers.backend, "host_pids", [])}
        self.left.append(sorted(f for pid in pids for f in block_files() if f.startswith(f"{PREFIX}-{pid}-")))
        return metrics


def run(rl_files, out, *overrides):
    config = small_config(
        rl_files, out, "data.val_path=", "preset=online_dpo", "trainer.total_steps=2", *overrides
    )
    trainer = PairCountingTrainer(config)
    return trainer.fit().history, trainer


def test_stored_pairs_materialise_as_the_controllers_pairs(tmp_path):
    """The pairs picked by rewriting a ``BatchRef``'s rows, materialised and given the rank's pair
    fields, equal :func:`best_worst_pairs` of the ``Batch``, field for field, bit for bit."""
    batch = scored_groups([[0.1, 0.9, 0.5], [0.3, 0.3, 0.3], [1.0, 0.0, 0.2], [0.2, 0.4, 0.6]])
    batch = batch.assign(tensors={"ref_log_probs": torch.randn(12, 3)})
    pairs, _ = best_worst_pairs(batch, n=3, world_size=1)
    store = ShmStore(str(tmp_path))
    ref = BatchRef.put(batch, store, ["prompts", "responses", "response_mask", "ref_log_probs"])
    rows, _ = best_worst_rows(batch["token_level_scores"].sum(-1), n=3, world_size=1)
    assert rows.tolist() == [1, 0, 6, 7, 11, 9]  # each group's best, then worst; the tie left out
    fetched = stored_pairs(ref, rows).materialise(get)
    ref.release(store.release)
    made = with_pair_fields(fetched.select([k for k in fetched.keys() if k != "token_level_scores"]))
    for name in ("prompts", "responses", "response_mask", "loss_mask", "pair", "chosen", "micro_batch_unit"):
        assert torch.equal(made[name], pairs[name]), name
    expected = (pairs["ref_log_probs"] * pairs["response_mask"]).sum(-1)
    assert torch.equal(made["ref_log_prob"], expected)


def test_in_process_online_dpo_on_references_matches_the_batch_path(rl_files, tmp_path):
    """Two online-DPO steps, one in-process worker: every metric equal bit for bit; the draw stays
    stored; the controller fetches no stored field outside the workers' calls; each update fetches
    exactly the wire bytes of its declared fields of the pairs' rows; every block put is released
    and no file is left."""
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false")
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "dataplane.enabled=true")
    used = traffic() - counters
    assert not differences(off, on)
    assert all(step["online_dpo/groups_with_preference"] > 0 for step in on[1:])
    assert_draws_stay_stored(_Views(refs.draws))
    assert refs.own_fetched == [0, 0]
    assert refs.update_by_field == refs.update_expected and len(refs.update_expected) == 2
    # the update's ids are read as the prompts and responses they are made of ("What is not stored")
    assert {"prompts", "responses", "ref_log_probs"} <= set(refs.update_expected[0])
    assert "input_ids" not in refs.update_expected[0]
    assert "loss_mask" not in refs.update_expected[0]  # made on the rank
    assert used.blocks_released == used.blocks_put > 0
    assert refs.left == [[], []]


class _Views:
    """``assert_draws_stay_stored``'s view of the draws (the step's controller batch: the draw's scalars)."""

    def __init__(self, draws):
        self.draws, self.views = draws, [draw.scalars for draw in draws]


@pytest.mark.slow  # two 2-step runs over 2 spawned workers: about two minutes on 2 loaded cores
def test_online_dpo_on_references_moves_no_payload_through_the_controller(rl_files, tmp_path):
    off, today = run(rl_files, tmp_path / "off", "dataplane.enabled=false", "trainer.n_workers=2")
    on, refs = run(rl_files, tmp_path / "on", "trainer.n_workers=2", "dataplane.enabled=true")
    assert not differences(off, on)
    assert refs.own_fetched == [0, 0]
    print(f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}")
    assert all(step > 0 for step in today.step_bytes)
    assert refs.step_bytes == [0, 0]  # generation, scoring, pairs, reference pass, update: no Batch
    assert refs.left == [[], []]


@pytest.mark.slow  # two 2-step one-step-off runs with a rollout replica: about a minute on 2 cores
def test_online_dpo_on_the_replicas_blocks_matches_the_batch_path(rl_files, tmp_path):
    """``one_step_off``: the pairs are references into the replica's blocks; metrics equal the
    ``Batch`` path's (but the queue's bytes: a block is not a sample file)."""
    mode = ("pipeline.mode=one_step_off", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1")
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false", *mode)
    on, refs = run(rl_files, tmp_path / "on", "dataplane.enabled=true", *mode)
    kept = [{k: v for k, v in step.items() if not k.startswith("pipeline/inflight_bytes")} for step in off]
    assert not differences(
        kept, [{k: v for k, v in s.items() if k in o} for s, o in zip(on, kept, strict=True)]
    )
    assert all(isinstance(draw, BatchRef) for draw in refs.draws)
    assert refs.own_fetched == [0, 0]
