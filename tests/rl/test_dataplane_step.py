"""``dataplane.enabled``: the policy-gradient step's stages on ``BatchRef`` s give, step for step
on a fixed seed, the metrics of today's ``Batch`` path, while the controller serialises no batch
payload in the step (today: the whole batch to every rank, for every stage) and leaves no block
files in ``/dev/shm``.

The controller's bytes are counted by :func:`tandem.protocol.traffic.batch_traffic` around each
step's ``_policy_gradient_update`` and around its generation. In ``sync`` mode the draw itself stays
on the workers that generated it (:mod:`tandem.pipeline.stored_rollout`): a ``BatchRef`` reaches
the controller, which scores the decoded texts and reads, of the stored fields, only what the
advantages need, counted with :func:`tandem.dataplane.traffic`: none, since the advantages run on
the actor's ranks from per-row scalars (:mod:`tandem.rl.ref_advantages`; their own comparisons
are in tests/rl/test_dataplane_advantages.py).
"""

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tandem.dataplane import BatchRef, traffic
from tandem.dataplane import get as get_block
from tandem.dataplane.shm import PREFIX
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.protocol.traffic import batch_traffic
from tandem.rl import RLTrainer
from tandem.rl.rank_advantages import PART_READS
from tandem.rl.step_data import RefStep
from tandem.rl.worker import ACTOR_UPDATE_FIELDS
from tests.dataplane.conftest import stored_bytes_by_field
from tests.rl.conftest import small_config
from tests.rl.test_dataplane_advantages import assert_equal_but_reduced


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
        self.part_by_field: list[Counter] = []  # what each advantage part's call fetched, by field
        self.part_expected: list[Counter] = []  # its declared reads of its rows, on the wire
        self.part_inline: list[dict[str, tuple]] = []  # the per-row tensors it sent back inline: shape, bytes
        self._fetched_in_parts = 0
        self.own_put: list[int] = []  # store bytes put in the step (by this process)

    def collect_batch(self, timings):
        before = batch_traffic()
        result = super().collect_batch(timings)
        self.gen_bytes.append((batch_traffic() - before).total)
        return result

    def train_step(self):
        self._fetched_in_updates = self._fetched_in_parts = 0
        self.probed = Counter()
        parts_before = len(self.part_by_field)
        before, start = traffic().fetched_bytes, traffic()
        metrics = super().train_step()
        self.own_fetched.append(
            traffic().fetched_bytes
            - before
            - self._fetched_in_updates
            - self._fetched_in_parts
            - self.probed.total()
        )
        self.own_put.append((traffic() - start).put_bytes)  # the ranks' too when they run in this process
        own = Counter((traffic() - start).fetched_by_field)
        own.subtract(self.probed)
        for updates in self.update_by_field[len(self.own_by_field) :]:
            own.subtract(updates)
        for part in self.part_by_field[parts_before:]:
            own.subtract(part)
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

    def _count_advantage_parts(self) -> None:
        """Wrap the actor group's ``compute_advantage_part`` (once) to count what each call fetched,
        what it declared of its rows, and what it sent back inline."""
        call = self.workers.compute_advantage_part
        if getattr(call, "counted", False):
            return

        def counted(ref, **kwargs):
            before, start = traffic().fetched_bytes, traffic()
            out = call(ref, **kwargs)
            self._fetched_in_parts += traffic().fetched_bytes - before
            self.part_by_field.append(Counter((traffic() - start).fetched_by_field))
            self.part_expected.append(reads_on_wire(ref, PART_READS, self.probed))
            if isinstance(out, BatchRef):  # (the optimal token baseline's sums come back as they are)
                inline = out.scalars.tensors.items()
                self.part_inline.append({k: (tuple(t.shape), t.nbytes) for k, t in inline})
            return out

        counted.counted = True
        self.workers.compute_advantage_part = counted

    def _policy_gradient_update(self, batch, timings):
        self._count_advantage_parts()
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
    wire form: the round trip is bit-exact) and the asked rows' values summed, by the stored field
    read (``stored_bytes_by_field``: a derived field's sources). What this fetch itself costs is
    added to ``probed``, to be left out."""
    before = traffic()
    expected, seen = Counter(), set()
    for part in ref.parts:
        names = part.stored_names(f for f in reads if f in part.fields)  # an alias: its stored field
        assert not seen & set(names), f"fields {seen & set(names)} stored twice"  # one fetch a field
        seen.update(names)
        for b in np.unique(part.block_of_row) if names else ():
            block = part.blocks[b]
            rows = np.unique(part.row_in_block[part.block_of_row == b]).tolist()
            whole = get_block(block, [c.name for c in block.columns], range(block.rows))
            expected.update(stored_bytes_by_field(whole, names, rows))
    probed.update((traffic() - before).fetched_by_field)
    return +expected


def block_files() -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"{PREFIX}-*")]


def run(rl_files, out, *overrides):
    trainer = CountingTrainer(small_config(rl_files, out, "data.val_path=", *overrides))
    return trainer.fit().history, trainer


def controller_fetches(steps) -> list[tuple[int, dict[str, int]]]:
    """Per step, the store bytes the controller itself fetched (in total, and by field): the
    step's own bytes (outside the updates' and advantage parts' calls) less the stages' calls and
    the probes of them; ``steps`` zips those per step."""
    out = []
    for own, own_by_field, stage_bytes, stage_fields, probe in steps:
        fields = Counter(own_by_field)
        fields.subtract(stage_fields)
        fields.subtract(probe)
        out.append((own - stage_bytes - probe.total(), {k: v for k, v in fields.items() if v}))
    return out


def inline_bytes_per_step(trainer) -> list[int]:
    """The bytes of the per-row tensors the advantage parts sent back inline, per step (two parts a step)."""
    sizes = [sum(nbytes for _, nbytes in part.values()) for part in trainer.part_inline]
    return [sum(sizes[i : i + 2]) for i in range(0, len(sizes), 2)]


def assert_equal_metrics(one: list[dict], two: list[dict], whitened: bool = False) -> None:
    """Every metric but the wall-clock ones equal, bit for bit, but the means over tokens the
    advantages on the ranks reduce from per-row partial sums (``REDUCED_FROM_PARTIALS``); after a
    ``whitened`` estimator's advantages, to float32 rounding (``assert_equal_but_reduced``)."""
    assert_equal_but_reduced(one, two, whitened)


def test_in_process_grpo_with_the_draw_stored_matches_the_batch_path_and_reads_no_token(
    rl_files, tmp_path, monkeypatch
):
    """The fast sibling: one in-process worker (the controller's process), two GRPO steps (with
    the reference's log-probs for the KL loss). The metrics equal today's step for step; the draws
    stay in the store; every block put is released, no file left. Counted by field, each fetch is
    exactly the wire bytes of what it declares, of its rows: the reference stage its forward
    fields (``FORWARD_FIELDS``), the advantage parts the response mask (``PART_READS``, of which
    the controller sends each part only what it needs), the update ``ACTOR_UPDATE_FIELDS`` (those
    the step holds); the controller, outside those calls (they run in this process here), fetches
    nothing. What the advantage parts send back inline is ``[B]`` scalars, the same bytes with
    responses twice as long."""
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
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false")
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "dataplane.enabled=true")
    used = traffic() - counters
    assert_equal_metrics(off, on)
    assert_draws_stay_stored(refs)
    assert len(in_stages) == 2 and all(in_stages)  # the reference stage read its forward fields
    assert stage_by_field == stage_expected
    # the forward's ids are read as the prompts and responses they are made of; its attention mask
    # (ones in a window) and positions (derived from it) cost no value byte
    assert set(stage_expected[0]) == {"prompts", "responses"}
    assert refs.update_by_field == refs.update_expected and len(refs.update_expected) == 2
    assert {"advantages", "ref_log_probs", "rollout_log_probs"} <= set(refs.update_expected[0])
    steps = zip(refs.own_fetched, refs.own_by_field, in_stages, stage_by_field, stage_probes, strict=True)
    assert controller_fetches(steps) == [(0, {}), (0, {})]  # no field of the stored step, no token, no mask
    assert refs.part_by_field == refs.part_expected and len(refs.part_expected) == 4  # two parts a step
    # GRPO: the score and its column come inline; the response mask they read is ones in a window,
    # its rows' lengths and starts alone (no value byte)
    assert set().union(*refs.part_expected) == set()
    inline = inline_bytes_per_step(refs)
    assert all(shape == (16,) for part in refs.part_inline for shape, _ in part.values())  # [B] each
    # twice the response length: the controller still fetches nothing and gets the same [B] scalars
    longer_on, longer = run(
        rl_files, tmp_path / "longer", "dataplane.enabled=true", "rollout.max_response_length=12"
    )
    steps = zip(
        longer.own_fetched,
        longer.own_by_field,
        in_stages[2:],
        stage_by_field[2:],
        stage_probes[2:],
        strict=True,
    )
    assert controller_fetches(steps) == [(0, {}), (0, {})]
    assert inline_bytes_per_step(longer) == inline == [16 * 6 * 4] * 2  # 6 float32 scalars a row
    assert longer.part_by_field == longer.part_expected
    assert used.blocks_released == used.blocks_put > 0  # the draws' blocks too
    assert refs.left == [[], []]


@pytest.mark.parametrize(
    "overrides, stored",
    [
        (("algorithm.adv_estimator=gae",), True),
        (("teacher.model_path=MODEL", "algorithm.distill.objective=reverse_kl", "teacher.top_k=2"), True),
        (("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2"), True),
        pytest.param(("algorithm.adv_estimator=optimal_token_baseline",), True, marks=pytest.mark.slow),
    ],
    ids=["ppo-critic", "distill-top-k", "dynamic-sampling", "otb-position-sums"],
)
def test_in_process_the_step_on_references_matches_the_batch_path_and_releases_its_blocks(
    rl_files, tmp_path, overrides, stored
):
    """One in-process worker, one step; the teacher (the policy's own model: only the path of its
    outputs matters here) keeps its top-k too. DAPO's dynamic sampling keeps its draws stored too
    (its groups are concatenated as references). The optimal token baseline reads other rows'
    tokens through sums per group and position, added on the controller (tests/rl/test_dataplane_otb.py)."""
    overrides = [o.replace("MODEL", rl_files["model"]) for o in overrides]
    off, _ = run(rl_files, tmp_path / "off", "dataplane.enabled=false", "trainer.total_steps=1", *overrides)
    counters = traffic()
    on, refs = run(rl_files, tmp_path / "on", "trainer.total_steps=1", "dataplane.enabled=true", *overrides)
    used = traffic() - counters
    assert_equal_metrics(off, on, whitened="algorithm.adv_estimator=gae" in overrides)
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
    off, today = run(rl_files, tmp_path / "off", "dataplane.enabled=false", "trainer.n_workers=2", *overrides)
    on, refs = run(rl_files, tmp_path / "on", "trainer.n_workers=2", "dataplane.enabled=true", *overrides)
    assert_equal_metrics(off, on, whitened=bool(overrides))  # PPO's GAE advantages are whitened
    assert refs.left == [[], []]  # every block of each step released when the step returned
    assert_draws_stay_stored(refs)
    print(
        f"controller batch bytes per step: today {today.step_bytes}, refs {refs.step_bytes}, "
        f"batch {today.batch_bytes}; in generation: today {today.gen_bytes}, refs {refs.gen_bytes}; "
        f"store bytes the controller fetched: refs {refs.own_fetched}"
    )
    for gen_today, gen_refs, batch in zip(today.gen_bytes, refs.gen_bytes, today.batch_bytes, strict=True):
        assert gen_refs + batch <= gen_today  # the generated batch no longer comes back; the request goes
    assert refs.own_fetched == [0, 0]  # the advantages ran on the ranks: the controller fetched no field
    assert refs.own_put == [0, 0]  # nor put one (today's advantages went back as a block)
    stages = 4 if overrides else 2  # old log-probs (and values), the update(s)
    for step, (bytes_today, bytes_refs) in enumerate(zip(today.step_bytes, refs.step_bytes, strict=True)):
        batch = today.batch_bytes[step]
        # today: each stage sends every row of the batch once (split over the 2 ranks); refs: none
        assert bytes_today >= stages * batch, (step, bytes_today, batch)
        assert bytes_refs == 0, (step, bytes_refs, batch)
