"""The advantages with ``dataplane.enabled``: per-row scalars on the controller, per-token work on
the actor's ranks (:mod:`tandem.rl.ref_advantages`, :mod:`tandem.rl.rank_advantages`).

References: the controller's path on the whole batch (:func:`tandem.rl.advantages.step_advantages`,
today's, with the setting off). The per-token outputs of the rank parts are compared with it bit
for bit, on the whole batch and split over two ranks' rows; a step's metrics with the setting on
and off on a fixed seed, bit for bit but for the metrics named in :data:`REDUCED_FROM_PARTIALS`
(a mean over tokens reduced from per-row partial sums: the same numbers added in another order).
The controller's store traffic in the step is counted: it fetches nothing, and what comes back
inline is a few ``[B]`` scalars, the same for two response lengths.
"""

from __future__ import annotations

import pytest
import torch

from tandem.algos import ADVANTAGE_ESTIMATORS, AdaptiveKLController, KLConfig, estimator_split
from tandem.algos.distill import DistillConfig
from tandem.algos.rollout_correction import RolloutCorrectionConfig
from tandem.controller import Worker, create_worker_group, register
from tandem.dataplane import DataPlaneConfig
from tandem.dataplane import get as get_block
from tandem.protocol import Batch
from tandem.rl import RLTrainer
from tandem.rl.advantages import step_advantages
from tandem.rl.config.algorithm import AlgorithmConfig
from tandem.rl.rank_advantages import PART_READS, REWARDS, SPREAD, advantage_part
from tandem.rl.ref_advantages import rank_advantages
from tandem.rl.step_data import RefStep
from tests.rl.conftest import assert_same_histories, small_config

# the metrics reduced from per-row partial sums on the ranks' side (a sum of the same numbers in
# another order: per row first, then over the rows), and the float64 variances of the critic's
REDUCED_FROM_PARTIALS = (
    "critic/advantages/mean",
    "critic/values/mean",
    "critic/returns/mean",
    "critic/vf_explained_var",
    "rollout_corr/kl",
    "rollout_corr/k3_kl",
    "rollout_corr/ratio_mean",
    "rollout_corr/is_weight_mean",
    "rollout_corr/is_ess",
    "distill/reverse_kl",
    "distill/teacher_log_prob",
    "distill/student_log_prob",
)


def measured(history: list[dict]) -> list[dict]:
    return [
        {
            k: v
            for k, v in step.items()
            if not k.startswith(("timing_s", "perf/")) and not k.endswith(("_s", "_gbps"))
        }
        for step in history
    ]


def differences(off: list[dict], on: list[dict]) -> dict[str, tuple[float, float]]:
    """``{step/metric: (off, on)}`` of every metric that is not equal bit for bit."""
    out = {}
    for step, (one, two) in enumerate(zip(measured(off), measured(on), strict=True), start=1):
        assert one.keys() == two.keys(), (step, one.keys() ^ two.keys())
        out.update({f"{step}/{k}": (one[k], two[k]) for k in one if one[k] != two[k]})
    return out


def assert_equal_but_reduced(off: list[dict], on: list[dict], whitened: bool = False) -> None:
    """Every metric equal bit for bit, but those of :data:`REDUCED_FROM_PARTIALS`, which agree to
    1e-6 relative (a few float32 roundings). With a ``whitened`` estimator (GAE with
    ``algorithm.whiten_gae``, REINFORCE++ and its baseline variant, GDPO) the whitening's mean and
    variance come from float64 per-row sums: an ulp off the float32 two-pass ones at times, so the
    advantages and everything the update computes from them agree to float32 rounding (1e-5
    relative, 1e-6 absolute for values near 0)."""
    if whitened:
        assert_same_histories(off, on, absolute=1e-6)
        return
    diff = differences(off, on)
    exact = {k: v for k, v in diff.items() if not k.split("/", 1)[1].startswith(REDUCED_FROM_PARTIALS)}
    assert not exact, exact
    for name, (one, two) in diff.items():
        assert two == pytest.approx(one, rel=1e-6, abs=1e-7), name


class AdvantageRanks(Worker):
    """Ranks that run the advantage parts as the actor's do (``ActorRolloutRefWorker``'s method)."""

    def __init__(self, algorithm: AlgorithmConfig) -> None:
        self.algorithm = algorithm

    @register(dispatch="DP_COMPUTE", reads=PART_READS, outputs="ref")
    def compute_advantage_part(self, batch, *, part, kl_coef, whitening):
        return advantage_part(batch, part, self.algorithm, kl_coef, whitening)


def step_batch(rows: int = 16, width: int = 7, seed: int = 0) -> Batch:
    """A step's controller batch: 4-response groups, masks with holes (tool tokens) and ragged
    ends, an outcome score on each row's last valid token, and every stage output an estimator or
    correction may read."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths[:, None]).to(torch.int64)
    mask[::5, 1] = 0
    scores = torch.zeros(rows, width)
    last = (torch.arange(width) * mask).argmax(-1)
    scores[torch.arange(rows), last] = torch.randint(0, 3, (rows,), generator=g).float()
    old = -torch.rand(rows, width, generator=g) * 2
    return Batch(
        {
            "response_mask": mask,
            "token_level_scores": scores,
            "old_log_probs": old,
            "rollout_log_probs": old + 0.3 * torch.randn(rows, width, generator=g),
            "ref_log_probs": old + 0.1 * torch.randn(rows, width, generator=g),
            "teacher_log_probs": old + 0.2 * torch.randn(rows, width, generator=g),
            "values": torch.randn(rows, width, generator=g),
            "reward_baselines": torch.rand(rows, generator=g),
            "reward_components": torch.rand(rows, 2, generator=g),
            "sum_pi_squared": torch.rand(rows, width, generator=g),  # the optimal token baseline's
        },
        {"uid": [f"p{i // 4}" for i in range(rows)]},
    )


SPLIT_ESTIMATORS = [n for n in ADVANTAGE_ESTIMATORS.names() if estimator_split(n).part != "batch"]
KL_IN_REWARD = KLConfig(use_kl_in_reward=True, coef=0.2, estimator="k2")
CORRECTION = RolloutCorrectionConfig(
    is_level="token", rejection="token", rejection_low=0.8, veto_threshold=0.2
)
SEQUENCE_CORRECTION = RolloutCorrectionConfig(is_level="sequence", rejection="geometric", rejection_low=0.9)


@pytest.mark.parametrize("estimator", SPLIT_ESTIMATORS)
@pytest.mark.parametrize(
    "settings",
    [{}, {"kl": KL_IN_REWARD, "rollout_correction": CORRECTION},
     {"rollout_correction": SEQUENCE_CORRECTION, "distill": DistillConfig(objective="reverse_kl", reward_coef=0.5)}],
    ids=["plain", "kl-in-reward-token-correction", "sequence-correction-distill"],
)  # fmt: skip
def test_the_rank_parts_give_the_controllers_tensors_and_metrics(estimator, settings):
    """Every estimator whose parts run apart, on the controller's path and on the ranks'
    (an in-process group, the real dispatch and store): the tensors the updates read are equal bit
    for bit, but a whitening estimator's advantages, whose mean and variance come from float64
    per-row sums (within 1e-6); the metrics too, but those reduced from per-row partial sums."""
    keys = ("a", "b") if estimator == "gdpo" else ()
    algorithm = AlgorithmConfig(adv_estimator=estimator, gdpo_reward_keys=keys, **settings)
    batch = step_batch()
    on_controller, on_ranks = AdaptiveKLController(0.2, 0.1, 100), AdaptiveKLController(0.2, 0.1, 100)
    expected, expected_metrics = step_advantages(batch, algorithm, on_controller)
    group = create_worker_group(AdvantageRanks, args=(algorithm,))
    data = RefStep(batch, DataPlaneConfig())
    try:
        view, metrics, updates = rank_advantages(data, group, algorithm, on_ranks)
        got = updates.materialise(get_block, [f for f in expected.tensors.keys() if f in updates])
    finally:
        data.release()
        group.shutdown()
    split = estimator_split(estimator)
    whitens = split.whiten(algorithm.advantage_config())
    for name in ("token_level_rewards", "advantages", "response_mask", "returns", "rollout_is_weights"):
        if name not in expected:
            continue
        if whitens and (name == "advantages" or (name == "returns" and split.part == "row")):
            torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6)
        else:
            assert torch.equal(got[name], expected[name]), name
    assert torch.equal(view["sequence_reward"], expected["token_level_rewards"].sum(-1))
    assert on_ranks.value == on_controller.value  # the adaptive KL coefficient saw the same KL
    reduced = {k for k in metrics if k.startswith(REDUCED_FROM_PARTIALS)}
    assert {k: v for k, v in metrics.items() if k not in reduced and k in expected_metrics} == {
        k: v for k, v in expected_metrics.items() if k not in reduced
    }
    for name in reduced & expected_metrics.keys():
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-6, abs=1e-7), name


def test_each_part_is_row_by_row_so_any_split_over_ranks_gives_the_same_rows():
    """The parts on two ranks' rows (uneven) equal the rows of the part on the whole batch, every
    per-token and per-row output, bit for bit: GAE with the KL penalty and a token correction, and
    GRPO's spread of per-row advantages."""
    batch = step_batch(rows=16)
    for algorithm, scalars in [
        (AlgorithmConfig(adv_estimator="gae", kl=KL_IN_REWARD, rollout_correction=CORRECTION), (0.1, 2.0)),
        (AlgorithmConfig(adv_estimator="grpo"), None),
    ]:
        whole = advantage_part(batch, REWARDS, algorithm, 0.2, None)
        halves = [
            advantage_part(batch[rows], REWARDS, algorithm, 0.2, None) for rows in (slice(0, 5), slice(5, 16))
        ]
        assert_rows_equal(whole, Batch.concat(halves))
        spread_in = batch.select(["response_mask", "teacher_log_probs", "old_log_probs"]).assign(
            tensors={k: whole[k] for k in whole.keys() if k in PART_READS}
        )
        if algorithm.adv_estimator == "grpo":
            spread_in = spread_in.assign(tensors={"row_advantage": torch.randn(16)})
        whole = advantage_part(spread_in, SPREAD, algorithm, 0.2, scalars)
        halves = [
            advantage_part(spread_in[r], SPREAD, algorithm, 0.2, scalars) for r in (slice(0, 5), slice(5, 16))
        ]
        assert_rows_equal(whole, Batch.concat(halves))


def assert_rows_equal(one: Batch, two: Batch) -> None:
    assert one.keys() == two.keys()
    for name in one.keys():
        assert torch.equal(one[name], two[name]), name


def run(rl_files, out, *overrides):
    overrides = [o.replace("MODEL", rl_files["model"]) for o in overrides]
    return (
        RLTrainer(small_config(rl_files, out, "data.val_path=", "trainer.total_steps=1", *overrides))
        .fit()
        .history
    )


ALL_AT_ONCE = (
    "algorithm.adv_estimator=gae",
    "algorithm.kl.use_kl_in_reward=true",
    "algorithm.kl.coef=0.1",
    "algorithm.rollout_correction.is_level=token",
    "teacher.model_path=MODEL",
    "algorithm.distill.objective=reverse_kl",
)  # a critic's GAE, the KL penalty in the reward, old log-probs and their correction, a teacher


def test_in_process_ppo_with_every_per_token_input_gives_todays_metrics(rl_files, tmp_path):
    """The fast sibling of the next test: one step of one in-process worker with every per-token
    input of the advantages at once, on and off."""
    off = run(rl_files, tmp_path / "off", "dataplane.enabled=false", *ALL_AT_ONCE)
    assert_equal_but_reduced(
        off, run(rl_files, tmp_path / "on", "dataplane.enabled=true", *ALL_AT_ONCE), whitened=True
    )


@pytest.mark.slow  # five pairs of one-step runs: about two minutes on 2 cores
@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.adv_estimator=gae",),
        ("algorithm.kl.use_kl_in_reward=true", "algorithm.kl.coef=0.1"),
        ("algorithm.rollout_correction.is_level=token", "algorithm.rollout_correction.rejection=token",
         "algorithm.rollout_correction.rejection_low=0.99"),
        ("teacher.model_path=MODEL", "algorithm.distill.objective=reverse_kl"),
        ("algorithm.adv_estimator=reinforce_plus_plus_baseline",),
    ],
    ids=["ppo-gae", "grpo-kl-in-reward", "grpo-old-log-probs-correction", "distill", "rpp-baseline-whitened"],
)  # fmt: skip
def test_in_process_the_advantages_on_the_ranks_give_todays_metrics(rl_files, tmp_path, overrides):
    off = run(rl_files, tmp_path / "off", "dataplane.enabled=false", *overrides)
    whitened = any(o.endswith(("=gae", "=reinforce_plus_plus_baseline")) for o in overrides)
    assert_equal_but_reduced(
        off, run(rl_files, tmp_path / "on", "dataplane.enabled=true", *overrides), whitened
    )
