"""The update's per-token metrics do not depend on how the mini-batch is split: one micro-batch
against several of unequal token counts, and one rank against two (run here in one process, each
"rank" scoring its rows with the mini-batch's global counts, as ``global_normalizer`` gives
them), through the real engine, the actor's loss and the worker's reduction. Averaging each
micro-batch's own token mean, as the reduction did before, differs by up to 25% here."""

from __future__ import annotations

import pytest
import torch

from tandem.algos import LossNormalizer, PolicyLossConfig
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.engine.base import TokenOutputs
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.protocol import Batch
from tandem.rl.actor_loss import make_actor_loss
from tandem.rl.critic_worker import value_loss
from tandem.rl.metric_shares import reduce_metric
from tandem.rl.step_metrics import reduced_worker_metrics

PROMPT, RESPONSE, ROWS = 5, 7, 8


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[int, TorchTrainEngine]:
    """One engine per micro-batch size (padded micro-batches of that many rows), the same weights."""
    path = save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", TinyModelConfig(family="qwen2"))
    built = {}
    for micro in (ROWS, 3, 1):
        built[micro] = TorchTrainEngine(
            EngineConfig(model_path=str(path), use_packing=False, micro_batch_size=micro)
        )
        built[micro].initialize()
    return built


@pytest.fixture(scope="module")
def engine(engines) -> TorchTrainEngine:
    return engines[ROWS]


def rl_batch(engine: TorchTrainEngine) -> Batch:
    """``ROWS`` responses of 1 to ``RESPONSE`` tokens (one empty) after left-padded prompts, with
    old and rollout log-probs away from the policy's, so that clipping and the mismatch show."""
    gen = torch.Generator().manual_seed(3)
    prompt_mask = (torch.arange(PROMPT) >= torch.randint(0, 3, (ROWS, 1), generator=gen)).long()
    lengths = torch.tensor([7, 1, 6, 0, 2, 7, 3, 5])
    response_mask = (torch.arange(RESPONSE) < lengths[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    input_ids = torch.randint(6, 40, (ROWS, PROMPT + RESPONSE), generator=gen) * attention_mask
    batch = Batch(
        {"input_ids": input_ids, "attention_mask": attention_mask, "prompts": input_ids[:, :PROMPT]}
    )
    current = engine.forward_backward(batch, None, forward_only=True).outputs.log_probs[:, PROMPT:]
    noise = 0.3 * torch.randn(ROWS, RESPONSE, generator=gen)
    return batch.assign(
        tensors={
            "response_mask": response_mask,
            "old_log_probs": (current + noise) * response_mask,
            "rollout_log_probs": (current - noise) * response_mask,
            "advantages": torch.randn(ROWS, RESPONSE, generator=gen) * response_mask,
        }
    )


def rank_metrics(
    engine: TorchTrainEngine, rows: Batch, normalizer: LossNormalizer, old_from_current: bool
) -> dict[str, float]:
    """One rank's metrics of one optimizer step over ``rows`` in ``engine``'s micro-batches,
    reduced as ``ActorRolloutRefWorker.update_actor`` reduces them (the loss and its metrics
    without the backward pass: the weights stay as they are for the next call). ``old_from_current``: the on-policy step, which
    measures the rollout mismatch (``rollout_corr/*``) and clips nothing."""
    loss_fn = make_actor_loss(
        PolicyLossConfig(), normalizer, entropy_coeff=0.01, old_from_current=old_from_current
    )
    result = engine.forward_backward(rows, loss_fn, forward_only=True)
    per_step = {name: reduce_metric(name, values) for name, values in result.metrics.items()}
    return {name: reduce_metric(name, [value], over_steps=True) for name, value in per_step.items()}


def log_probs(engine: TorchTrainEngine, rows: Batch) -> torch.Tensor:
    """``[len(rows), RESPONSE]`` the policy's log-probs of the rows' response tokens."""
    return engine.forward_backward(rows, None, forward_only=True).outputs.log_probs[:, PROMPT:]


def split_rounding(engines: dict[int, TorchTrainEngine], batch: Batch) -> float:
    """The most a response token's log-prob moves when the forward runs in the splits' micro-batches
    instead of one (this host's kernels round a matmul by its shape: 2 ulp on the AVX-512 host
    where the test's old ``rel=1e-6`` failed)."""
    mask = batch["response_mask"].bool()
    whole = log_probs(engines[ROWS], batch)
    moved = [log_probs(engines[3], batch), log_probs(engines[1], batch)]
    moved.append(torch.cat([log_probs(engines[3], batch[:3]), log_probs(engines[3], batch[3:])]))
    return max(float((m - whole)[mask].abs().max()) for m in moved)


@pytest.mark.parametrize("old_from_current", [False, True], ids=["off-policy", "on-policy"])
def test_token_mean_metrics_are_the_same_for_any_micro_batch_and_rank_split(engines, old_from_current):
    """To the split's own rounding: each metric is a token mean of a function of the token's
    log-prob whose slope is at most ``max(1, |advantage| x ratio)`` (the KLs' is 1, the policy
    loss's the other), so a split that moves every log-prob by at most ``delta`` moves the metric
    by at most that slope times ``delta``. Far inside the 25% of the old reduction."""
    batch = rl_batch(engines[ROWS])
    whole = LossNormalizer.from_mask(batch["response_mask"])
    one = rank_metrics(engines[ROWS], batch, whole, old_from_current)
    splits = {
        "three micro-batches": rank_metrics(engines[3], batch, whole, old_from_current),
        "one row each": rank_metrics(engines[1], batch, whole, old_from_current),
        "two ranks": reduced_worker_metrics(
            [rank_metrics(engines[3], rows, whole, old_from_current) for rows in (batch[:3], batch[3:])]
        ),
    }
    shows = "rollout_corr/kl" if old_from_current else "actor/pg_clipfrac"
    assert abs(one[shows]) > 0.01  # clipping or the mismatch shows, so the split could matter
    mask = batch["response_mask"].bool()
    current = log_probs(engines[ROWS], batch)
    apart = torch.maximum((current - batch["old_log_probs"]).abs(), (current - batch["rollout_log_probs"]).abs())
    largest_ratio = float(torch.exp(apart[mask]).max())
    slope = max(1.0, float(batch["advantages"].abs().max()) * largest_ratio)
    bound = slope * split_rounding(engines, batch) + 1e-9
    for label, split in splits.items():
        assert split.keys() == one.keys(), label
        for name in one.keys() - {"rollout_corr/max_abs_log_prob_diff"}:
            assert split[name] == pytest.approx(one[name], rel=1e-6, abs=bound), (label, name)
        if old_from_current:
            assert split["rollout_corr/max_abs_log_prob_diff"] == one["rollout_corr/max_abs_log_prob_diff"]


def test_one_micro_batchs_metrics_are_its_token_means(engine):
    """The reference for the test above: with the whole mini-batch in one micro-batch the shares
    are the plain token means, computed here from the engine's outputs."""
    batch = rl_batch(engine)
    mask = batch["response_mask"].float()
    one = rank_metrics(engine, batch, LossNormalizer.from_mask(batch["response_mask"]), old_from_current=True)
    outputs = engine.forward_backward(batch, None, forward_only=True).outputs
    entropy = outputs.entropy[:, PROMPT:]
    assert one["actor/entropy"] == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-6)
    difference = (outputs.log_probs[:, PROMPT:] - batch["rollout_log_probs"]) * mask
    assert one["rollout_corr/kl"] == pytest.approx(float(-difference.sum() / mask.sum()), rel=1e-5)


def test_critic_metrics_are_the_same_for_any_split():
    """The critic's ``vf_clipfrac`` and ``vpred_mean`` over row splits of unequal token counts,
    through ``value_loss`` and the reduction, against the whole batch."""
    gen = torch.Generator().manual_seed(5)
    mask = (torch.arange(RESPONSE) < torch.tensor([7, 1, 6, 0, 2, 7, 3, 5])[:, None]).long()
    values = torch.randn(ROWS, RESPONSE, generator=gen)
    batch = Batch(
        {
            "prompts": torch.zeros(ROWS, PROMPT, dtype=torch.long),
            "response_mask": mask,
            "returns": torch.randn(ROWS, RESPONSE, generator=gen),
            "values": values + 0.5 * torch.randn(ROWS, RESPONSE, generator=gen),
        }
    )
    full_values = torch.cat([torch.zeros(ROWS, PROMPT), values], dim=1)
    normalizer = LossNormalizer.from_mask(mask)

    def metrics(parts: list[list[int]]) -> dict[str, float]:
        per_micro: dict[str, list[float]] = {}
        for rows in parts:
            _, shares = value_loss(
                batch[rows],
                TokenOutputs(values=full_values[rows]),
                clip=0.2,
                mode="token-mean",
                normalizer=normalizer,
            )
            for name, value in shares.items():
                per_micro.setdefault(name, []).append(float(value))
        return {name: reduce_metric(name, listed) for name, listed in per_micro.items()}

    one = metrics([list(range(ROWS))])
    for parts in ([[0, 1, 2], [3, 4, 5, 6, 7]], [[row] for row in range(ROWS)]):
        split = metrics(parts)
        for name, value in one.items():
            assert split[name] == pytest.approx(value, rel=1e-6), (parts, name)
