"""GKD's dataset steps (``algorithm.distill.lmbda < 1``): some steps train on the training rows'
own responses instead of rollouts. This module is all of it the step plan holds:

* the batch source: its stage wraps the run's (``batch_source=``) in a
  :class:`tandem.rl.dataset_responses.DatasetResponseMix`, which decides step by step which source
  a step draws from (the rollout's, or the dataset's responses) and, with the data plane on, has
  the dataset rows built on the ranks that read them;
* the pass: a dataset step was sampled by no rollout, so the actor's log-probs stand for both its
  old and its rollout log-probs; both are made on the ranks and kept there (no per-token field of
  the step reaches the controller: the draw, the log-probs and the copy are references).
"""

from __future__ import annotations

from typing import Any

from tandem.rl.dataset_responses import OFF_POLICY, DatasetResponseMix
from tandem.rl.metrics import timed
from tandem.rl.stages.base import register_step_stage
from tandem.rl.stages.dynamic_sampling import filters_groups


def _mixes_dataset_steps(config: Any) -> bool:
    return config.algorithm.distill.lmbda < 1


def is_dataset_step(batch: Any) -> bool:
    """Whether the step's responses are the dataset's (GKD), not sampled: no rollout log-probs."""
    return OFF_POLICY in batch and bool(batch[OFF_POLICY][0])


def check_dataset_steps(config: Any, plan: Any) -> None:
    """The colocated pipeline (dataset steps are drawn step by step) and no group filter (a dataset
    step's groups hold one response each)."""
    lmbda, mode = config.algorithm.distill.lmbda, config.pipeline.mode
    if mode != "sync":
        raise ValueError(
            f"algorithm.distill.lmbda={lmbda} with pipeline.mode={mode}: steps on the "
            "dataset's responses are drawn step by step, which the asynchronous pipelines' rollout ahead of "
            "the trainer does not do yet; use pipeline.mode=sync"
        )
    if filters_groups(config):
        raise ValueError(
            f"algorithm.distill.lmbda={lmbda} with algorithm.filter_groups.enable: a step on the "
            "dataset's responses has one response per group, so no group would ever be kept"
        )


def dataset_response_mix(config: Any, source: Any, inputs: Any) -> DatasetResponseMix:
    """The run's batch ``source`` (the colocated rollout) with the dataset's steps mixed in;
    ``inputs``: :class:`tandem.rl.batch_source.SourceInputs` (stored draws: rows built on the ranks)."""
    distill = config.algorithm.distill
    return DatasetResponseMix(
        source, inputs.train_data, inputs.sampler, inputs.shape, inputs.tokenizer,
        distill.lmbda, distill.response_key, config.rollout.max_response_length,
        inputs.workers if inputs.in_store else None, inputs.prompt_width,
    )  # fmt: skip


@register_step_stage(
    "dataset_old_log_probs",
    "pass",
    applies=_mixes_dataset_steps,
    order=11,
    rule=check_dataset_steps,
    batch_source=dataset_response_mix,
)
def dataset_old_log_probs(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """A dataset step's ``old_log_probs`` (unless the plan's ``old_log_probs`` pass made them) and
    its ``rollout_log_probs``: the same values, copied on the ranks that hold them."""
    if not is_dataset_step(data.batch):
        return
    workers = trainer.workers
    with timed(timings, "old_log_prob"):
        if trainer.plan.old_log_probs != "pass":
            data.stage(workers, workers.compute_log_prob)
        data.stage(workers, workers.rollout_log_probs_from_old, joined=True)
