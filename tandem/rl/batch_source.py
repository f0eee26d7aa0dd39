"""Where an RL run's steps get their prompt groups: the workers' own engines (``pipeline.mode=sync``),
rollout replicas beside them (the asynchronous modes), a recorded asynchronous run's schedule
(``pipeline.replay``), and GKD's mix of sampled and dataset responses over the colocated source
(``algorithm.distill.lmbda < 1``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.dataplane import DataPlaneConfig
from tandem.pipeline.colocated import ColocatedRollout
from tandem.pipeline.replay import ReplaySource
from tandem.pipeline.runner import AsyncRollout
from tandem.pipeline.schedule_record import ScheduleRecord
from tandem.pipeline.source import BatchSource
from tandem.rl.config import TrainConfig
from tandem.rl.data import RLDataset
from tandem.rl.dataset_responses import DatasetResponseMix
from tandem.rl.derived import replica_plan, step_shape
from tandem.rl.step_data import rollout_stays_in_store
from tandem.rl.step_plan import build_step_plan
from tandem.run.sampler import EpochSampler


def rl_batch_source(
    config: TrainConfig, workers: Any, train_data: RLDataset, sampler: EpochSampler, tokenizer: Any
) -> BatchSource:
    """The run's :class:`BatchSource` over the actor's ``workers``, drawing ``train_data``'s prompts
    in ``sampler``'s order; a draw stays in the data plane's store when
    :func:`tandem.rl.step_data.rollout_stays_in_store` says so."""
    pad_id, distill = tokenizer.pad_token_id, config.algorithm.distill
    width = max(len(sample.prompt_ids) for sample in train_data.samples)  # a stored draw's prompt width
    in_store = rollout_stays_in_store(
        config, any(s.images for s in train_data.samples), build_step_plan(config)
    )
    if config.pipeline.replay:
        check_replayable(config)
        return ReplaySource(
            config.pipeline.replay, train_data, sampler, config.rollout.n, pad_id, replayed_settings(config)
        )
    if config.pipeline.record_schedule:
        ScheduleRecord(config.pipeline.record_schedule).write_run(replayed_settings(config))
    if config.pipeline.disaggregated:
        kept = DataPlaneConfig(config.dataplane.engine, config.dataplane.directory)
        return AsyncRollout(
            replica_plan(config), workers, train_data, sampler, pad_id, kept if in_store else None, width
        )
    source = ColocatedRollout(workers, pad_id, train_data, sampler, step_shape(config), in_store, width)
    if distill.lmbda < 1:  # GKD: some steps train on the dataset's responses
        return DatasetResponseMix(
            source, train_data, sampler, step_shape(config), tokenizer,
            distill.lmbda, distill.response_key, config.rollout.max_response_length,
        )  # fmt: skip
    return source


def replayed_settings(config: TrainConfig) -> dict[str, Any]:
    """What a replay must share with the run it replays (``pipeline.replay``), by the keys the user
    writes: the model, the prompts, the batch's shape, the seed, the mode and every ``algorithm.*``."""
    settings: dict[str, Any] = {
        "model_path": config.model_path,
        "data.train_path": config.data.train_path,
        "data.train_batch_size": config.data.train_batch_size,
        "data.max_prompt_length": config.data.max_prompt_length,
        "rollout.n": config.rollout.n,
        "rollout.max_response_length": config.rollout.max_response_length,
        "trainer.seed": config.trainer.seed,
        "pipeline.mode": config.pipeline.mode,
    }
    settings.update(_flattened("algorithm", dataclasses.asdict(config.algorithm)))
    return settings


def check_replayable(config: TrainConfig) -> None:
    """A replay runs no rollout engine: refuse what would generate, naming its key."""
    if config.data.val_path:
        raise ValueError(
            "pipeline.replay runs no rollout engine, and validation generates: set data.val_path= for a replay"
        )
    if config.algorithm.needs_greedy_baseline:
        raise ValueError(
            f"pipeline.replay runs no rollout engine, and algorithm.adv_estimator={config.algorithm.adv_estimator} "
            "generates greedy baselines each step"
        )
    if config.agent.enabled:
        raise ValueError(
            "pipeline.replay does not replay agent episodes yet (their conversations are not in the "
            "sample log): this run has agent.* settings"
        )


def _flattened(prefix: str, tree: Any) -> dict[str, Any]:
    """``{"<prefix>.<key>...": leaf}`` of a nested dict."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flattened(f"{prefix}.{key}", value))
    return out
