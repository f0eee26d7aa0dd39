"""Where an RL run's steps get their prompt groups: the workers' own engines (``pipeline.mode=sync``),
rollout replicas beside them (the asynchronous modes) or a recorded asynchronous run's schedule
(``pipeline.replay``); the step plan's stages may wrap that source with their own
(``StepStage.batch_source``: GKD's dataset steps, :mod:`tandem.rl.stages.dataset_steps`), so the
plan answers which source a step draws from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.dataplane import DataPlaneConfig
from tandem.pipeline.colocated import ColocatedRollout
from tandem.pipeline.replay import ReplaySource
from tandem.pipeline.runner import AsyncRollout
from tandem.pipeline.schedule_record import ScheduleRecord
from tandem.pipeline.source import BatchSource, StepShape
from tandem.rl.config import TrainConfig
from tandem.rl.data import RLDataset
from tandem.rl.data.prompt_rows import PromptPlaces
from tandem.rl.derived import replica_plan, step_shape
from tandem.rl.step_data import rollout_stays_in_store
from tandem.rl.step_plan import build_step_plan
from tandem.run.sampler import EpochSampler


@dataclass(frozen=True)
class SourceInputs:
    """What a stage's ``batch_source`` may build on: the actor's ``workers``, the training prompts
    ``train_data`` in ``sampler``'s order, the ``tokenizer``, one draw's ``shape``; ``in_store``:
    the run's draws stay in the data plane, their prompts ``prompt_width`` tokens wide."""

    workers: Any
    train_data: RLDataset
    sampler: EpochSampler
    tokenizer: Any
    shape: StepShape
    in_store: bool
    prompt_width: int


def rl_batch_source(
    config: TrainConfig,
    workers: Any,
    train_data: RLDataset,
    sampler: EpochSampler,
    tokenizer: Any,
    val_data: RLDataset | None = None,
) -> BatchSource:
    """The run's :class:`BatchSource` over the actor's ``workers``, drawing ``train_data``'s prompts
    in ``sampler``'s order; a draw stays in the data plane's store when
    :func:`tandem.rl.step_data.rollout_stays_in_store` says so, and so do the responses to
    ``val_data``'s prompts (:func:`tandem.rl.validation.scored_validation`)."""
    pad_id, plan = tokenizer.pad_token_id, build_step_plan(config)
    width = stored_prompt_width(config, train_data, val_data)
    in_store = rollout_stays_in_store(config, any(s.images for s in train_data.samples), plan)
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
            replica_plan(config), workers, train_data, sampler, pad_id, kept if in_store else None, width,
            prompt_places(config, train_data, val_data) if in_store else None,
        )  # fmt: skip
    shape = step_shape(config)
    source = ColocatedRollout(
        workers, pad_id, train_data, sampler, shape, in_store, width, config.agent.uses_program
    )
    inputs = SourceInputs(workers, train_data, sampler, tokenizer, shape, in_store, width)
    return plan.batch_source(config, source, inputs)


def prompt_places(
    config: TrainConfig, train_data: RLDataset, val_data: RLDataset | None = None
) -> PromptPlaces | None:
    """The training (and validation) prompts' sources, for rollout replicas that read the rows of
    the prompt groups they are sent by place (ids, images, an agent episode's messages): a dataset
    :meth:`RLDataset.load` read; ``None`` where the groups carry them. A validation set not read by
    :meth:`RLDataset.load` sends its rows' ids."""
    if train_data.source is None:
        return None
    read = [data.source for data in (train_data, val_data) if data is not None and data.source is not None]
    return PromptPlaces(tuple({source.key: source for source in read}.values()))


def stored_prompt_width(config: TrainConfig, train_data: RLDataset, val_data: RLDataset | None = None) -> int:
    """The prompt columns of a stored draw's rows: the widest training or validation prompt (the
    validation responses are stored at the draws' widths); for agent episodes on rollout replicas
    at least ``data.max_prompt_length``, as their prompts are rendered with the tools' schemas, and
    for an agent program's, in every mode, ``rollout.max_response_length`` more (its system prompt
    counts against that budget: :mod:`tandem.agents.program.recorder`; in ``sync`` its draws are
    laid out at this width stored or not). Padding costs no stored byte; the draw is cropped to its
    longest prompt."""
    samples = [*train_data.samples, *(val_data.samples if val_data is not None else [])]
    width = max(len(sample.prompt_ids) for sample in samples)
    if not (config.agent.enabled and (config.pipeline.disaggregated or config.agent.uses_program)):
        return width
    width = max(width, config.data.max_prompt_length)
    return width + (config.rollout.max_response_length if config.agent.uses_program else 0)


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
    """A replay runs no rollout engine: refuse what would generate, naming its key (the plan's
    stages say what of theirs would: ``StepStage.replay``)."""
    if config.data.val_path:
        raise ValueError(
            "pipeline.replay runs no rollout engine, and validation generates: set data.val_path= for a replay"
        )
    for reason in build_step_plan(config).replay_refusals(config):
        raise ValueError(f"pipeline.replay runs no rollout engine, and {reason}")
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
