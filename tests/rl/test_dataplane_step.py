"""``dataplane.enabled``: the policy-gradient step's stages on ``BatchRef`` s give, step for step
on a fixed seed, the metrics of today's ``Batch`` path, while the controller serialises no batch
payload in the step (today: the whole batch to every rank, for every stage) and leaves no block
files in ``/dev/shm``.

The controller's bytes are counted by :func:`tandem.protocol.traffic.batch_traffic` around each
step's ``_policy_gradient_update`` (rollout and scoring, outside it, are the same on both paths).
"""

import os
from pathlib import Path

import pytest

from tandem.dataplane import traffic
from tandem.dataplane.shm import PREFIX
from tandem.protocol.traffic import batch_traffic
from tandem.rl import RLTrainer
from tests.rl.conftest import small_config


class CountingTrainer(RLTrainer):
    """An RLTrainer that records the controller's batch bytes of each policy-gradient step, the
    bytes of the padded batch that step started from, and the block files of the run's processes
    (controller and ranks) still in ``/dev/shm`` when the step has returned."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_bytes: list[int] = []
        self.batch_bytes: list[int] = []
        self.left: list[list[str]] = []

    def _policy_gradient_update(self, batch, timings):
        self.batch_bytes.append(sum(t.nbytes for t in batch.tensors.values()))
        before = batch_traffic()
        result = super()._policy_gradient_update(batch, timings)
        self.step_bytes.append((batch_traffic() - before).total)
        pids = {os.getpid()}
        for group in (self.workers, self.critics):
            pids.update(getattr(group.backend, "host_pids", []) if group is not None else [])
        self.left.append(sorted(f for pid in pids for f in block_files() if f.startswith(f"{PREFIX}-{pid}-")))
        return result


def block_files() -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"{PREFIX}-*")]


def run(rl_files, out, *overrides):
    trainer = CountingTrainer(small_config(rl_files, out, "data.val_path=", *overrides))
    return trainer.fit().history, trainer


def assert_equal_metrics(one: list[dict], two: list[dict]) -> None:
    """Every metric but the wall-clock ones equal, bit for bit."""

    def measured(history):
        return [
            {
                k: v
                for k, v in step.items()
                if not k.startswith(("timing_s", "perf/")) and not k.endswith(("_s", "_gbps"))
            }
            for step in history
        ]

    assert measured(one) == measured(two)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("algorithm.adv_estimator=gae",),
        ("teacher.model_path=MODEL", "algorithm.distill.objective=reverse_kl", "teacher.top_k=2"),
    ],
    ids=["grpo", "ppo-critic", "distill-top-k"],
)
def test_in_process_the_step_on_references_matches_the_batch_path_and_releases_its_blocks(
    rl_files, tmp_path, overrides
):
    """The fast sibling: one in-process worker (the controller's process), one step; the teacher
    (the policy's own model: only the path of its outputs matters here) keeps its top-k too."""
    overrides = [o.replace("MODEL", rl_files["model"]) for o in overrides]
    off, _ = run(rl_files, tmp_path / "off", "trainer.total_steps=1", *overrides)
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "trainer.total_steps=1", "dataplane.enabled=true", *overrides)
    used = traffic() - counters
    assert_equal_metrics(off, on)
    assert used.blocks_put > 0 and used.fetched_bytes > 0  # the stages did go through the store
    assert used.blocks_released == used.blocks_put  # released by the step that put them
    assert refs.left == [[]]  # no block file left once the step returned


@pytest.mark.slow  # two 2-step runs over 2 spawned workers: about a minute on 2 cores
@pytest.mark.parametrize(
    "overrides",
    [(), ("algorithm.adv_estimator=gae", "critic.placement=separate")],
    ids=["grpo", "ppo-critic"],
)
def test_the_step_on_references_matches_the_batch_path_and_moves_no_payload(rl_files, tmp_path, overrides):
    off, today = run(rl_files, tmp_path / "off", "trainer.n_workers=2", *overrides)
    on, refs = run(rl_files, tmp_path / "on", "trainer.n_workers=2", "dataplane.enabled=true", *overrides)
    assert_equal_metrics(off, on)
    assert refs.left == [[], []]  # every block of each step released when the step returned
    print(
        f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}, "
        f"batch {today.batch_bytes}"
    )
    stages = 4 if overrides else 2  # old log-probs (and values), the update(s)
    for step, (bytes_today, bytes_refs) in enumerate(zip(today.step_bytes, refs.step_bytes, strict=True)):
        batch = today.batch_bytes[step]
        # today: each stage sends every row of the batch once (split over the 2 ranks); refs: none
        assert bytes_today >= stages * batch, (step, bytes_today, batch)
        assert bytes_refs == 0, (step, bytes_refs, batch)
