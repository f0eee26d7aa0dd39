"""Rollout correction (TIS / MIS / veto) and mismatch diagnostics against loop references."""

import math

import pytest
import torch

from tandem.algos import RolloutCorrectionConfig, compute_rollout_correction
from tests.algos import reference as ref


def mismatched(seed=0, batch=6, length=5):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(batch, length, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.randn(batch, length, generator=gen, dtype=torch.float64) * 0.4
    rollout[0, 0] = old[0, 0] - 3.0  # one token far off (ratio e^3)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[2] = 0
    mask = (torch.arange(length) < lengths.unsqueeze(1)).long()
    return old, rollout, mask


def rho(old, rollout, i, t):
    return math.exp(float(old[i, t]) - float(rollout[i, t]))


def seq_log_rho(old, rollout, mask, i):
    return sum(float(old[i, t]) - float(rollout[i, t]) for t in ref.valid_positions(mask[i]))


@pytest.mark.parametrize("seed", [0, 1])
def test_token_tis_weights(seed):
    old, rollout, mask = mismatched(seed)
    out = compute_rollout_correction(
        old, rollout, mask, RolloutCorrectionConfig(is_level="token", is_threshold=1.5)
    )
    for i in range(6):
        for t in range(5):
            expected = min(rho(old, rollout, i, t), 1.5) if mask[i, t] else 0.0
            assert math.isclose(float(out.is_weights[i, t]), expected, rel_tol=1e-12, abs_tol=1e-15)
    assert torch.equal(out.response_mask, mask)
    kept = [min(rho(old, rollout, i, t), 1.5) for i in range(6) for t in ref.valid_positions(mask[i])]
    ess = sum(kept) ** 2 / (len(kept) * sum(w * w for w in kept))
    assert math.isclose(float(out.metrics["rollout_corr/is_ess"]), ess, rel_tol=1e-12)
    assert math.isclose(float(out.metrics["rollout_corr/is_weight_max"]), max(kept))


def test_sequence_tis_weights():
    old, rollout, mask = mismatched(2)
    out = compute_rollout_correction(
        old, rollout, mask, RolloutCorrectionConfig(is_level="sequence", is_threshold=3.0)
    )
    for i in range(6):
        w = min(math.exp(seq_log_rho(old, rollout, mask, i)), 3.0)
        for t in range(5):
            assert math.isclose(float(out.is_weights[i, t]), w if mask[i, t] else 0.0, rel_tol=1e-12)


@pytest.mark.parametrize("mode", ["token", "sequence", "geometric"])
def test_rejection_masks(mode):
    old, rollout, mask = mismatched(3)
    cfg = RolloutCorrectionConfig(rejection=mode, rejection_low=0.7, rejection_high=1.4)
    out = compute_rollout_correction(old, rollout, mask, cfg)
    for i in range(6):
        pos = ref.valid_positions(mask[i])
        for t in range(5):
            if t not in pos:
                accept = False
            elif mode == "token":
                accept = 0.7 <= rho(old, rollout, i, t) <= 1.4
            elif mode == "sequence":
                accept = 0.7 <= math.exp(seq_log_rho(old, rollout, mask, i)) <= 1.4
            else:
                accept = 0.7 <= math.exp(seq_log_rho(old, rollout, mask, i) / len(pos)) <= 1.4
            assert int(out.response_mask[i, t]) == int(accept), (i, t)
    masked = 1 - out.response_mask.sum().item() / mask.sum().item()
    assert math.isclose(float(out.metrics["rollout_corr/masked_frac"]), masked)


def test_veto_drops_whole_sequences():
    old, rollout, mask = mismatched(0)
    rollout[0, 0] = old[0, 0] + 5.0  # ratio e^-5 on one token of sequence 0
    out = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig(veto_threshold=1e-2))
    assert out.response_mask[0].sum() == 0
    for i in range(1, 6):
        vetoed = any(rho(old, rollout, i, t) < 1e-2 for t in ref.valid_positions(mask[i]))
        assert torch.equal(out.response_mask[i], mask[i] * (0 if vetoed else 1))


def test_diagnostics_match_loop_and_are_neutral_on_policy():
    old, rollout, mask = mismatched(4)
    metrics = compute_rollout_correction(old, rollout, mask, RolloutCorrectionConfig()).metrics
    cells = [(i, t) for i in range(6) for t in ref.valid_positions(mask[i])]
    diffs = [float(old[c]) - float(rollout[c]) for c in cells]
    assert math.isclose(float(metrics["rollout_corr/kl"]), -ref.mean(diffs), rel_tol=1e-12)
    assert math.isclose(
        float(metrics["rollout_corr/k3_kl"]), ref.mean([math.exp(d) - 1 - d for d in diffs]), rel_tol=1e-12
    )
    assert math.isclose(float(metrics["rollout_corr/max_abs_log_prob_diff"]), max(abs(d) for d in diffs))
    per_seq = [
        math.exp(-ref.mean([float(old[i, t]) - float(rollout[i, t]) for t in ref.valid_positions(mask[i])]))
        for i in range(6)
        if ref.valid_positions(mask[i])
    ]
    assert math.isclose(float(metrics["rollout_corr/ppl_ratio"]), ref.mean(per_seq), rel_tol=1e-12)

    same = compute_rollout_correction(
        old, old.clone(), mask, RolloutCorrectionConfig(is_level="token")
    ).metrics
    assert float(same["rollout_corr/kl"]) == 0 and float(same["rollout_corr/ratio_mean"]) == 1
    assert float(same["rollout_corr/ppl_ratio"]) == 1 and float(same["rollout_corr/is_ess"]) == pytest.approx(
        1.0
    )


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="rollout_correction.is_level='tok'"):
        RolloutCorrectionConfig(is_level="tok")
    with pytest.raises(ValueError, match="rejection_high=0.4 must exceed rejection_low=0.5"):
        RolloutCorrectionConfig(rejection_high=0.4)
