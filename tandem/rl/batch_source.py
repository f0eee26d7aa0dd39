"""Where an RL run's steps get their prompt groups: the workers' own engines (``pipeline.mode=sync``),
rollout replicas beside them (the asynchronous modes), and GKD's mix of sampled and dataset
responses over the colocated source (``algorithm.distill.lmbda < 1``)."""

from __future__ import annotations

from typing import Any

from tandem.dataplane import DataPlaneConfig
from tandem.pipeline.colocated import ColocatedRollout
from tandem.pipeline.runner import AsyncRollout
from tandem.pipeline.source import BatchSource
from tandem.rl.config import TrainConfig
from tandem.rl.data import RLDataset
from tandem.rl.dataset_responses import DatasetResponseMix
from tandem.rl.derived import replica_plan, step_shape
from tandem.rl.step_data import rollout_stays_in_store
from tandem.run.sampler import EpochSampler


def rl_batch_source(
    config: TrainConfig, workers: Any, train_data: RLDataset, sampler: EpochSampler, tokenizer: Any
) -> BatchSource:
    """The run's :class:`BatchSource` over the actor's ``workers``, drawing ``train_data``'s prompts
    in ``sampler``'s order; a draw stays in the data plane's store when
    :func:`tandem.rl.step_data.rollout_stays_in_store` says so."""
    pad_id, distill = tokenizer.pad_token_id, config.algorithm.distill
    in_store = rollout_stays_in_store(config, any(s.images for s in train_data.samples))
    if config.pipeline.disaggregated:
        kept = DataPlaneConfig(config.dataplane.engine, config.dataplane.directory)
        return AsyncRollout(
            replica_plan(config), workers, train_data, sampler, pad_id, kept if in_store else None
        )
    source = ColocatedRollout(workers, pad_id, train_data, sampler, step_shape(config), in_store)
    if distill.lmbda < 1:  # GKD: some steps train on the dataset's responses
        return DatasetResponseMix(
            source, train_data, sampler, step_shape(config), tokenizer,
            distill.lmbda, distill.response_key, config.rollout.max_response_length,
        )  # fmt: skip
    return source
