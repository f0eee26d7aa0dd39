"""The optimal token baseline's advantages on the ranks (``EstimatorSplit("positions")``): each rank
sums its rows' baseline terms per group and response position, the controller adds the ranks'
``[g, R]`` sums and puts the groups' baselines as one block of ``G`` rows, and the spread part's
ranks fetch their groups' rows of it (:mod:`tandem.rl.ref_advantages`). The controller fetches no
per-token field. Against the controller's path (:func:`tandem.rl.advantages.step_advantages`):
bit for bit where each group's rows are on one rank; a group split over two ranks adds its second
rank's rows first, then to the first rank's sum, so its sums may round differently (within 1e-6)."""

from collections import Counter

import pytest
import torch

from tandem.algos import AdaptiveKLController
from tandem.algos.rollout_correction import RolloutCorrectionConfig
from tandem.controller import ResourcePool, create_worker_group
from tandem.dataplane import DataPlaneConfig, traffic
from tandem.dataplane import get as get_block
from tandem.protocol import Batch
from tandem.protocol.traffic import batch_traffic
from tandem.rl import RLTrainer
from tandem.rl.advantages import step_advantages
from tandem.rl.config.algorithm import AlgorithmConfig
from tandem.rl.rank_advantages import REWARDS, advantage_part, position_sums
from tandem.rl.ref_advantages import rank_advantages
from tandem.rl.row_fields import OTB_GROUP
from tandem.rl.step_data import RefStep
from tests.rl.conftest import small_config
from tests.rl.test_dataplane_advantages import AdvantageRanks, assert_equal_but_reduced, step_batch

OTB = "algorithm.adv_estimator=optimal_token_baseline"
GROUPS = [5, 5, 4, 1]  # 15 rows: padded to 16 for two ranks; the second group straddles them


def uneven_groups() -> Batch:
    """:func:`step_batch`'s 15 first rows in groups of 5, 5, 4 and 1 (responses of ragged lengths)."""
    batch = step_batch(rows=16, width=7, seed=3)[:15]
    uids = [f"g{g}" for g, size in enumerate(GROUPS) for _ in range(size)]
    return Batch(batch.tensors, {"uid": uids})


def test_position_sums_of_two_ranks_rows_add_up_to_the_whole_batchs():
    """The fast sibling of the next test: the sums part on two ranks' rows (8 + 8, the last a pad
    row marked -1), added in rank order, equal the whole batch's sums per group and position, bit
    for bit but the group over both ranks (1e-6); the pad row counts nowhere."""
    algorithm = AlgorithmConfig(adv_estimator="optimal_token_baseline")
    batch = uneven_groups()
    rewards = advantage_part(batch, REWARDS, algorithm, 0.0, None)
    rows = batch.select(["response_mask", "old_log_probs", "sum_pi_squared"]).assign(
        tensors={"token_level_rewards": rewards["token_level_rewards"]}
    )
    ids = torch.tensor([g for g, size in enumerate(GROUPS) for _ in range(size)])
    whole = position_sums(rows.assign(tensors={OTB_GROUP: ids}))
    padded, pad = rows.pad_to_divisor(2)
    padded = padded.assign(tensors={OTB_GROUP: torch.cat([ids, torch.full((pad,), -1)])})
    added = {name: torch.zeros_like(whole[name]) for name in ("weighted", "weights")}
    for half in padded.chunk(2):
        sums = position_sums(half)
        for name in added:
            added[name].index_add_(0, sums["groups"], sums[name])
    for name in added:
        assert torch.equal(added[name][[0, 2, 3]], whole[name][[0, 2, 3]]), name  # one rank each
        torch.testing.assert_close(added[name], whole[name], rtol=0, atol=1e-6)


@pytest.mark.slow  # two spawned ranks: about 45 s on 2 loaded cores
@pytest.mark.parametrize(
    "correction", [None, RolloutCorrectionConfig(is_level="token")], ids=["plain", "token-weights"]
)
def test_the_position_sums_on_two_ranks_give_the_controllers_advantages(correction):
    """Two spawned ranks (the rows split 8 + 8 with one pad row, a group over both): the updates'
    tensors against the controller's path, bit for bit but the straddling group's rows (1e-6);
    the metrics too, but those reduced from per-row partials; the controller fetches 0 stored
    bytes and serialises no ``Batch``."""
    settings = {} if correction is None else {"rollout_correction": correction}
    algorithm = AlgorithmConfig(adv_estimator="optimal_token_baseline", **settings)
    batch = uneven_groups()
    expected, expected_metrics = step_advantages(batch, algorithm, AdaptiveKLController(0.2, 0.1, 100))
    group = create_worker_group(AdvantageRanks, ResourcePool((2,)), args=(algorithm,))
    group.use_data_store(DataPlaneConfig())
    data = RefStep(batch, DataPlaneConfig())
    try:
        before, sent = traffic(), batch_traffic()
        _, metrics, updates = rank_advantages(data, group, algorithm, AdaptiveKLController(0.2, 0.1, 100))
        used, serialised = traffic() - before, (batch_traffic() - sent).total
        got = updates.materialise(get_block, ["advantages", "token_level_rewards", "response_mask"])
    finally:
        data.release()
        group.shutdown()
    assert used.fetched_bytes == 0 and serialised == 0
    assert used.put_bytes > 0  # the groups' baselines: one block of G rows
    straddling = torch.arange(15).ge(5) & torch.arange(15).lt(10)  # group 1: rows 5-7 and 8-9
    for name in ("token_level_rewards", "response_mask"):
        assert torch.equal(got[name], expected[name]), name
    assert torch.equal(got["advantages"][~straddling], expected["advantages"][~straddling])
    torch.testing.assert_close(got["advantages"], expected["advantages"], rtol=0, atol=1e-6)
    for name, value in expected_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-6, abs=1e-7), name


class CountingTrainer(RLTrainer):
    """Records the store bytes each step fetched outside the actor group's calls (the controller's
    own) and, by field, what those calls fetched."""

    CALLS = ("compute_log_prob", "compute_ref_log_prob", "compute_advantage_part", "update_actor")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.own_fetched: list[int] = []
        self.in_calls_by_field: Counter = Counter()
        self._in_calls = 0

    def _wrap(self) -> None:
        for name in self.CALLS:
            call = getattr(self.workers, name)
            if getattr(call, "counted", False):
                continue

            def counted(*args, _call=call, **kwargs):
                start = traffic()
                out = _call(*args, **kwargs)
                used = traffic() - start
                self._in_calls += used.fetched_bytes
                self.in_calls_by_field.update(used.fetched_by_field)
                return out

            counted.counted = True
            setattr(self.workers, name, counted)

    def train_step(self):
        self._wrap()
        self._in_calls, start = 0, traffic().fetched_bytes
        metrics = super().train_step()
        self.own_fetched.append(traffic().fetched_bytes - start - self._in_calls)
        return metrics


def test_in_process_otb_on_references_matches_the_batch_path(rl_files, tmp_path):
    """One OTB step, one in-process worker, on and off: the metrics equal (bit for bit but the
    means reduced from per-row partials); the controller fetched no stored field; the ranks read
    the baselines' block (``otb_baseline``) and the per-token inputs of the sums."""

    def run(out, *overrides):
        config = small_config(rl_files, out, "data.val_path=", "trainer.total_steps=1", OTB, *overrides)
        trainer = CountingTrainer(config)
        return trainer.fit().history, trainer

    off, _ = run(tmp_path / "off", "dataplane.enabled=false")
    on, refs = run(tmp_path / "on", "dataplane.enabled=true")
    assert_equal_but_reduced(off, on)
    assert refs.own_fetched == [0]
    assert {"otb_baseline", "sum_pi_squared", "token_level_rewards"} <= set(refs.in_calls_by_field)
