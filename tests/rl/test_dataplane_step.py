"""``dataplane.enabled``: the policy-gradient step's stages on ``BatchRef`` s give, step for step
on a fixed seed, the metrics of today's ``Batch`` path, while the controller serialises no batch
payload in the step (today: the whole batch to every rank, for every stage) and leaves no block
files in ``/dev/shm``.

The controller's bytes are counted by :func:`tandem.protocol.traffic.batch_traffic` around each
step's ``_policy_gradient_update`` and around its generation. In ``sync`` mode the draw itself stays
on the workers that generated it (:mod:`tandem.pipeline.stored_rollout`): a ``BatchRef`` reaches
the controller, which scores the decoded texts and reads, of the stored fields, only what the
advantages need (:data:`CONTROLLER_READS`), counted with :func:`tandem.dataplane.traffic`.
"""

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.dataplane import BatchRef, traffic
from tandem.dataplane import get as get_block
from tandem.dataplane.columns import wire_nbytes
from tandem.dataplane.shm import PREFIX
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.protocol.traffic import batch_traffic
from tandem.rl import RLTrainer
from tandem.rl.step_data import RefStep
from tandem.rl.worker import ACTOR_UPDATE_FIELDS
from tests.dataplane.conftest import stored_nbytes
from tests.rl.conftest import small_config


class CountingTrainer(RLTrainer):
    """An RLTrainer that records the controller's batch bytes of each policy-gradient step, the
    bytes of the padded batch that step started from, and the block files of the run's processes
    (controller and ranks) still in ``/dev/shm`` when the step has returned."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.step_bytes: list[int] = []
        self.gen_bytes: list[int] = []
        self.batch_bytes: list[int] = []
        self.draws: list = []  # what the batch source handed the step: a Batch, or a BatchRef
        self.views: list = []  # the controller's batch of each step (its advantages' inputs)
        self.own_fetched: list[int] = []  # store bytes fetched in the step outside the updates' calls
        self.own_by_field: list[Counter] = []  # the same, by field (the reads_on_wire probes left out)
        self.update_by_field: list[Counter] = []  # what the updates' calls fetched, by field
        self.update_expected: list[Counter] = []  # their declared reads of their rows, on the wire
        self.probed = Counter()  # bytes the probes (reads_on_wire) fetched, to leave out
        self.left: list[list[str]] = []

    def collect_batch(self, timings):
        before = batch_traffic()
        result = super().collect_batch(timings)
        self.gen_bytes.append((batch_traffic() - before).total)
        return result

    def train_step(self):
        self._fetched_in_updates = 0
        self.probed = Counter()
        before, start = traffic().fetched_bytes, traffic()
        metrics = super().train_step()
        self.own_fetched.append(
            traffic().fetched_bytes - before - self._fetched_in_updates - self.probed.total()
        )
        own = Counter((traffic() - start).fetched_by_field)
        own.subtract(self.probed)
        for updates in self.update_by_field[len(self.own_by_field) :]:
            own.subtract(updates)
        self.own_by_field.append(Counter({k: v for k, v in own.items() if v}))
        return metrics

    def _updates(self, step, view, timings):
        if isinstance(step, BatchRef):  # one rank here: the update reads its declared fields of every row
            self.update_expected.append(reads_on_wire(step, ACTOR_UPDATE_FIELDS, self.probed))
        before, start = traffic().fetched_bytes, traffic()
        metrics = super()._updates(step, view, timings)
        self._fetched_in_updates += traffic().fetched_bytes - before
        self.update_by_field.append(Counter((traffic() - start).fetched_by_field))
        return metrics

    def _policy_gradient_update(self, batch, timings):
        self.draws.append(batch)
        if not isinstance(batch, BatchRef):
            self.batch_bytes.append(sum(t.nbytes for t in batch.tensors.values()))
        before = batch_traffic()
        result = super()._policy_gradient_update(batch, timings)
        self.step_bytes.append((batch_traffic() - before).total)
        self.views.append(result[0])
        pids = {os.getpid()}
        for group in (self.workers, self.critics):
            pids.update(getattr(group.backend, "host_pids", []) if group is not None else [])
        self.left.append(sorted(f for pid in pids for f in block_files() if f.startswith(f"{PREFIX}-{pid}-")))
        return result


TOKEN_COLUMNS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids")
CONTROLLER_READS = ("response_mask",)  # GRPO on-policy: the advantages' only stored input


def assert_draws_stay_stored(trainer) -> None:
    """Each step's draw reached the controller as references: every token column stored, no token
    id inline (not even the request's ``prompt_ids``), and its controller batch holds none."""
    for draw, view in zip(trainer.draws, trainer.views, strict=True):
        assert isinstance(draw, BatchRef)
        assert set(TOKEN_COLUMNS) <= set(draw.stored_fields())
        assert not set(TOKEN_COLUMNS) & set(draw.scalars.keys()) and "prompt_ids" not in draw.scalars
        assert not set(TOKEN_COLUMNS) & set(view.keys()) and "prompt_ids" not in view


def reads_on_wire(ref: BatchRef, reads: tuple[str, ...], probed: Counter) -> Counter:
    """The payload bytes, by field, of ``reads`` (those ``ref`` holds) of ``ref``'s distinct rows
    as they lie on the wire: each block's fields are fetched whole, re-encoded (the block's own
    wire form: the round trip is bit-exact) and the asked rows' values summed
    (``stored_nbytes``). What this fetch itself costs is added to ``probed``, to be left out."""
    before = traffic()
    expected, seen = Counter(), set()
    for part in ref.parts:
        names = [f for f in reads if f in part.fields]
        assert not seen & set(names), f"fields {seen & set(names)} stored twice"  # one fetch a field
        seen.update(names)
        for b in np.unique(part.block_of_row) if names else ():
            block = part.blocks[b]
            rows = np.unique(part.row_in_block[part.block_of_row == b]).tolist()
            whole = get_block(block, names, range(block.rows))
            expected.update({name: stored_nbytes(whole, [name], rows) for name in names})
    probed.update((traffic() - before).fetched_by_field)
    return +expected


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


def response_mask_bytes(view, width: int) -> int:
    """The wire bytes of the step's ``response_mask`` as its rows were stored (padded to the
    rollout's ``width`` columns): what the controller reads of a GRPO step's stored fields."""
    mask = view["response_mask"]
    return wire_nbytes({"response_mask": torch.nn.functional.pad(mask, (0, width - mask.shape[1]))})


def test_in_process_grpo_with_the_draw_stored_matches_the_batch_path_and_reads_no_token(
    rl_files, tmp_path, monkeypatch
):
    """The fast sibling: one in-process worker (the controller's process), two GRPO steps (with
    the reference's log-probs for the KL loss). The metrics equal today's step for step; the draws
    stay in the store; every block put is released, no file left. Counted by field, each fetch is
    exactly the wire bytes of what it declares, of its rows: the reference stage its forward
    fields (``FORWARD_FIELDS``), the update ``ACTOR_UPDATE_FIELDS`` (those the step holds), and
    the controller, outside those calls (they run in this process here), only the response mask:
    no token column."""
    in_stages: list[int] = []
    stage_by_field: list[Counter] = []
    stage_expected: list[Counter] = []
    stage_probes: list[Counter] = []  # what reads_on_wire fetched in each stage call (left out below)
    stage = RefStep.stage

    def counted_stage(self, group, method):
        before, start = traffic().fetched_bytes, traffic()
        stage(self, group, method)
        in_stages.append(traffic().fetched_bytes - before)
        stage_by_field.append(Counter((traffic() - start).fetched_by_field))
        stage_probes.append(Counter())
        stage_expected.append(reads_on_wire(self.first, FORWARD_FIELDS, stage_probes[-1]))

    monkeypatch.setattr(RefStep, "stage", counted_stage)  # counts, then runs the real stage
    off, _ = run(rl_files, tmp_path / "off")
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "dataplane.enabled=true")
    used = traffic() - counters
    assert_equal_metrics(off, on)
    assert_draws_stay_stored(refs)
    assert len(in_stages) == 2 and all(in_stages)  # the reference stage read its forward fields
    assert stage_by_field == stage_expected and {"input_ids", "position_ids"} <= set(stage_expected[0])
    assert refs.update_by_field == refs.update_expected and len(refs.update_expected) == 2
    assert {"advantages", "ref_log_probs", "rollout_log_probs"} <= set(refs.update_expected[0])
    masks = [response_mask_bytes(view, 6) for view in refs.views]
    steps = zip(refs.own_fetched, refs.own_by_field, in_stages, stage_by_field, stage_probes, strict=True)
    controller, controller_by_field = [], []
    for own, own_by_field, stage_bytes, stage_fields, probe in steps:
        controller.append(own - stage_bytes - probe.total())
        fields = Counter(own_by_field)
        fields.subtract(stage_fields)
        fields.subtract(probe)
        controller_by_field.append({k: v for k, v in fields.items() if v})
    assert controller == masks
    # a field whose rows are all fill (step 1's mask: every response ran to the 6 tokens) costs 0 bytes
    assert controller_by_field == [{"response_mask": mask} if mask else {} for mask in masks] and any(masks)
    assert used.blocks_released == used.blocks_put > 0  # the draws' blocks too
    assert refs.left == [[], []]


@pytest.mark.parametrize(
    "overrides, stored",
    [
        (("algorithm.adv_estimator=gae",), True),
        (("teacher.model_path=MODEL", "algorithm.distill.objective=reverse_kl", "teacher.top_k=2"), True),
        (("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"), False),
    ],
    ids=["ppo-critic", "distill-top-k", "dynamic-sampling"],
)
def test_in_process_the_step_on_references_matches_the_batch_path_and_releases_its_blocks(
    rl_files, tmp_path, overrides, stored
):
    """One in-process worker, one step; the teacher (the policy's own model: only the path of its
    outputs matters here) keeps its top-k too. DAPO's dynamic sampling still rebuilds the draws'
    batch on the controller: its step puts that batch once (``stored`` False)."""
    overrides = [o.replace("MODEL", rl_files["model"]) for o in overrides]
    off, _ = run(rl_files, tmp_path / "off", "trainer.total_steps=1", *overrides)
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "trainer.total_steps=1", "dataplane.enabled=true", *overrides)
    used = traffic() - counters
    assert_equal_metrics(off, on)
    if stored:
        assert_draws_stay_stored(refs)
    else:
        assert not isinstance(refs.draws[0], BatchRef)
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
    assert_draws_stay_stored(refs)
    print(
        f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}, "
        f"batch {today.batch_bytes}; in generation: today {today.gen_bytes}, refs {refs.gen_bytes}; "
        f"store bytes the controller fetched: refs {refs.own_fetched}"
    )
    for gen_today, gen_refs, batch in zip(today.gen_bytes, refs.gen_bytes, today.batch_bytes, strict=True):
        assert gen_refs + batch <= gen_today  # the generated batch no longer comes back; the request goes
    if not overrides:  # GRPO: the controller reads only the response mask of the stored fields
        assert refs.own_fetched == [response_mask_bytes(view, 6) for view in refs.views]
    stages = 4 if overrides else 2  # old log-probs (and values), the update(s)
    for step, (bytes_today, bytes_refs) in enumerate(zip(today.step_bytes, refs.step_bytes, strict=True)):
        batch = today.batch_bytes[step]
        # today: each stage sends every row of the batch once (split over the 2 ranks); refs: none
        assert bytes_today >= stages * batch, (step, bytes_today, batch)
        assert bytes_refs == 0, (step, bytes_refs, batch)
