"""``CriticWorker``: the value model of PPO, one process per rank in a worker group of its own.

Each rank holds a :class:`~tandem.engine.TorchTrainEngine` with a scalar head
(``engine.head=value``), computes ``V(s_t)`` on the response tokens of its shard before the
advantages are estimated, and trains on its shard with the clipped value loss
(:func:`tandem.algos.compute_value_loss`) for ``critic.ppo_epochs`` passes over
``critic.ppo_mini_batch_size`` mini-batches, dividing by the global token/sequence counts so
the result does not depend on the split. The controller (:mod:`tandem.rl.trainer`) calls it.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import torch

from tandem.algos import LossNormalizer, compute_value_loss
from tandem.algos.masked import masked_mean
from tandem.controller import Worker, mesh_dispatch, register
from tandem.engine.base import TokenOutputs
from tandem.engine.divergence import ModelHealth, SkippedUpdates
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.engine.on_rank import EngineCheckpoints, bind_rank, parameter_count, parked, start_engine
from tandem.protocol import Batch
from tandem.protocol.sequences import response_part
from tandem.rl.config import TrainConfig
from tandem.rl.derived import critic_engine_config
from tandem.rl.metric_shares import as_shares, reduce_metric

CRITIC_UPDATE_FIELDS = (*FORWARD_FIELDS, "response_mask", "returns", "values")  # update_critic's reads
CRITIC_MESH = "critic"  # the engine's data-parallel ranks: sequence/tensor-parallel peers get the same rows


def value_loss(
    micro: Batch, outputs: TokenOutputs, *, clip: float | None, mode: str, normalizer: LossNormalizer
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The clipped value loss of one micro-batch (its share of the mini-batch's), and metrics (each
    its share of the mini-batch's value: :mod:`tandem.rl.metric_shares`)."""
    width = micro["prompts"].shape[1]
    values = response_part(outputs.values, width)
    mask = micro["response_mask"]
    loss, metrics = compute_value_loss(
        values, micro["returns"], micro["values"], mask, clip, mode, normalizer
    )
    means = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": metrics["vf_clipfrac"],
        "critic/vpred_mean": masked_mean(values.detach(), mask.to(values.dtype)),
    }
    return loss, as_shares(means, mask, normalizer, already_shares=("critic/vf_loss",))


class CriticWorker(EngineCheckpoints, Worker):
    """One rank of the critic group (see the module docstring); its checkpoints are the engine's
    (:class:`~tandem.engine.on_rank.EngineCheckpoints`), its state on the device while they are written."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    @register(dispatch="ONE_TO_ALL")
    def init_model(self, schedule_steps: int) -> int:
        """Bind this rank's device and load the value model; returns its parameter count.
        ``schedule_steps`` is its learning-rate schedule's length over the run."""
        config = self.config
        self.device = device = bind_rank(self, config.trainer.device)
        strategy = config.critic.engine.strategy  # as configured: start_engine makes it the group's
        engine_config = critic_engine_config(config, str(device), strategy, schedule_steps)
        self.engine = start_engine(self, engine_config, mesh=CRITIC_MESH)
        self.skipped = SkippedUpdates(
            config.trainer.max_skipped_updates_in_a_row, "trainer.max_skipped_updates_in_a_row"
        )
        self._probe: Batch | None = None
        offload = config.critic.offload
        # waits on the CPU between its passes (when asked, on a GPU)
        self.residency = parked(self.engine, offload.params, offload.optimizer)
        return parameter_count(self.engine)

    @register(dispatch=mesh_dispatch(CRITIC_MESH), reads=FORWARD_FIELDS, outputs="ref")
    def compute_values(self, batch: Batch) -> Batch:
        """``values [B, R]``: ``V(s_t)`` of each response token under the current critic."""
        with self.residency.computing():
            outputs = self.engine.forward_backward(batch, None, forward_only=True).outputs
        return Batch({"values": response_part(outputs.values, batch["prompts"].shape[1])})

    @register(dispatch=mesh_dispatch(CRITIC_MESH), reads=CRITIC_UPDATE_FIELDS)
    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value-loss updates on this rank's shard (needs ``values`` and ``returns``);
        returns the metrics averaged over the optimizer steps."""
        config = self.config
        local_mini = config.critic_mini_batch_prompts * config.rollout.n // self.engine.mesh.dims.dp
        collected: dict[str, list[float]] = defaultdict(list)
        with self.residency.computing(optimizer=True):
            self._update_epochs(batch, local_mini, collected)
        self._probe = batch[:1]
        metrics = {name: reduce_metric(name, values, over_steps=True) for name, values in collected.items()}
        metrics["critic/skipped_updates_in_a_row"] = float(self.skipped.in_a_row)
        return metrics

    def _update_epochs(self, batch: Batch, local_mini: int, collected: dict[str, list[float]]) -> None:
        """``critic_epochs`` passes over this rank's mini-batches, one optimizer step each; metrics
        go into ``collected``."""
        critic, config = self.config.critic, self.config
        for _ in range(config.critic_epochs):
            for mini in batch.split(local_mini):
                normalizer = self.engine.global_normalizer(mini["response_mask"])
                loss_fn = functools.partial(
                    value_loss,
                    clip=critic.cliprange_value,
                    mode=config.critic_loss_agg_mode,
                    normalizer=normalizer,
                )
                result = self.engine.forward_backward(mini, loss_fn)
                grad_norm = self.engine.optimizer_step(skip=not math.isfinite(result.loss))
                self.skipped.record(self.engine.last_step_skipped)
                collected["critic/grad_norm"].append(grad_norm)
                collected["critic/lr"].append(self.engine.lr)
                if config.trainer.lr_schedule_unit == "optimizer_step":
                    self.engine.lr_step()
                for name, values in result.metrics.items():
                    collected[name].append(reduce_metric(name, values))
        if config.trainer.lr_schedule_unit == "step":
            self.engine.lr_step()

    @register(dispatch="ONE_TO_ALL")
    def critic_health(self) -> ModelHealth:
        """The critic's weights (this rank's shards) and the values of the last update's first
        sequence: finite or not (:mod:`tandem.engine.divergence`)."""
        with self.residency.computing():
            return self.engine.health(self._probe)
