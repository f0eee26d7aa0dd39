"""``pipeline.old_log_probs=rollout`` on a stored draw: the stage gives the stored
``rollout_log_probs`` a second name (``BatchRef.alias``) and the step's advantages read it as
``old_log_probs``, on the controller (``RefStep.view``) and on the ranks (``rank_advantages``).
Reference: today's path, the controller's ``Batch`` renamed by the same stage and
:func:`tandem.rl.advantages.step_advantages`; tensors and metrics equal bit for bit (but the
means the ranks reduce from per-row partial sums, as in tests/rl/test_dataplane_advantages.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.algos import AdaptiveKLController
from tandem.algos.rollout_correction import RolloutCorrectionConfig
from tandem.controller import create_worker_group
from tandem.dataplane import BatchRef, DataPlaneConfig, store_for, traffic
from tandem.dataplane import get as get_block
from tandem.dataplane import release as release_block
from tandem.pipeline.stored_rollout import LAST_SAMPLED
from tandem.protocol import Batch
from tandem.rl.advantages import advantage_reads, step_advantages
from tandem.rl.config.algorithm import AlgorithmConfig
from tandem.rl.ref_advantages import rank_advantages
from tandem.rl.row_fields import SEQUENCE_SCORE
from tandem.rl.scoring import token_level_scores
from tandem.rl.stages.old_log_probs import rollout_old_log_probs
from tandem.rl.step_data import RefStep
from tests.rl.test_dataplane_advantages import REDUCED_FROM_PARTIALS, AdvantageRanks

ROWS, WIDTH = 12, 6
ALGORITHM = AlgorithmConfig(
    adv_estimator="grpo", rollout_correction=RolloutCorrectionConfig(is_level="token", rejection="token")
)


class Producer:
    """The group that put the draw (the replicas): releases its blocks when the step ends."""

    def release_refs(self, ref: BatchRef) -> None:
        ref.release(release_block)


def draw(seed: int = 0) -> Batch:
    """A stored draw's rows as the controller would hold them on today's path: responses, the mask,
    the rollout's log-probs, and the per-row score on each row's last sampled token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (ROWS,), generator=g)
    mask = (torch.arange(WIDTH) < lengths[:, None]).to(torch.int64)
    return Batch(
        {
            "responses": torch.randint(1, 100, (ROWS, WIDTH), generator=g) * mask,
            "response_mask": mask,
            "rollout_log_probs": -torch.rand(ROWS, WIDTH, generator=g) * mask,
            SEQUENCE_SCORE: torch.randint(0, 3, (ROWS,), generator=g).float(),
            LAST_SAMPLED: lengths - 1,
        },
        {"uid": [f"p{i // 4}" for i in range(ROWS)]},
    )


def todays(batch: Batch) -> Batch:
    """The controller's batch on today's path, renamed by the stage."""
    scores = token_level_scores(batch[SEQUENCE_SCORE], batch[LAST_SAMPLED], WIDTH)
    return rollout_old_log_probs(None, batch.assign(tensors={"token_level_scores": scores}))


@pytest.fixture
def stored(tmp_path):
    config = DataPlaneConfig(directory=str(tmp_path))
    batch = draw()
    ref = rollout_old_log_probs(None, BatchRef.put(batch, store_for(config)))
    data = RefStep(ref, config, producer=Producer())
    yield batch, ref, data
    data.release()
    assert not list(tmp_path.iterdir())  # the draw's block, and anything the step put, released


def test_the_stage_aliases_a_stored_draw_and_renames_a_batch(stored):
    batch, ref, _ = stored
    assert ref.parts[0].stored_name("old_log_probs") == "rollout_log_probs"
    got = ref.materialise(get_block, ["old_log_probs", "rollout_log_probs"])
    expected = rollout_old_log_probs(None, batch)
    assert expected["old_log_probs"] is expected["rollout_log_probs"]  # today's path: the same tensor
    assert got.equals(expected.select(["old_log_probs", "rollout_log_probs"]))


def test_the_controllers_advantages_read_the_alias_as_todays_old_log_probs(stored):
    batch, ref, data = stored
    before = traffic()
    view = data.view(advantage_reads(ALGORITHM))
    assert set((traffic() - before).fetched_by_field) == {"rollout_log_probs"}  # the alias: no fetch more
    expected, expected_metrics = step_advantages(todays(batch), ALGORITHM, AdaptiveKLController(0.0, 0.0, 1))
    got, metrics = step_advantages(view, ALGORITHM, AdaptiveKLController(0.0, 0.0, 1))
    assert any(k.startswith("rollout_corr/") for k in metrics)  # the correction ran on old vs rollout
    assert metrics == expected_metrics
    for name in ("old_log_probs", "advantages", "response_mask", "rollout_is_weights"):
        assert torch.equal(got[name], expected[name]), name
    step = data.for_updates(got)
    assert "old_log_probs" in ref.stored_fields() and "old_log_probs" in step.stored_fields()
    assert torch.equal(
        step.materialise(get_block, ["old_log_probs"])["old_log_probs"], expected["old_log_probs"]
    )


def test_the_ranks_advantages_read_the_alias_as_todays_old_log_probs(stored):
    batch, _, data = stored
    expected, expected_metrics = step_advantages(todays(batch), ALGORITHM, AdaptiveKLController(0.0, 0.0, 1))
    group = create_worker_group(AdvantageRanks, args=(ALGORITHM,))
    try:
        view, metrics, updates = rank_advantages(data, group, ALGORITHM, AdaptiveKLController(0.0, 0.0, 1))
        names = ["old_log_probs", "advantages", "response_mask", "rollout_is_weights"]
        got = updates.materialise(get_block, names)
    finally:
        data.release()
        group.shutdown()
    for name in names:
        assert torch.equal(got[name], expected[name]), name
    reduced = {k for k in metrics if k.startswith(REDUCED_FROM_PARTIALS)}
    assert any(k.startswith("rollout_corr/") for k in expected_metrics)
    assert {k: v for k, v in metrics.items() if k not in reduced and k in expected_metrics} == {
        k: v for k, v in expected_metrics.items() if k not in reduced
    }
    for name in reduced & expected_metrics.keys():
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-6, abs=1e-7), name
