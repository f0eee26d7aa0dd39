"""GKD's dataset steps (``algorithm.distill.lmbda < 1``): a step whose responses are the training
rows' own (:class:`tandem.rl.dataset_responses.DatasetResponseMix`, the batch source) was sampled
by no rollout, so the actor's log-probs stand for both its old and its rollout log-probs."""

from __future__ import annotations

from typing import Any

from tandem.protocol import Batch
from tandem.rl.metrics import timed
from tandem.rl.stages.base import register_step_stage
from tandem.rl.stages.dynamic_sampling import filters_groups
from tandem.rl.stages.old_log_probs import is_dataset_step


def _mixes_dataset_steps(config: Any) -> bool:
    return config.algorithm.distill.lmbda < 1


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


@register_step_stage(
    "dataset_old_log_probs", "pass", applies=_mixes_dataset_steps, order=11, rule=check_dataset_steps
)
def dataset_old_log_probs(trainer: Any, data: Any, timings: dict[str, float]) -> None:
    """``old_log_probs`` of a dataset step, unless the plan's ``old_log_probs`` pass made them."""
    if is_dataset_step(data.batch) and trainer.plan.old_log_probs != "pass":
        with timed(timings, "old_log_prob"):
            data.stage(trainer.workers, trainer.workers.compute_log_prob)


@register_step_stage("dataset_rollout_log_probs", "view", applies=_mixes_dataset_steps, order=10)
def dataset_rollout_log_probs(trainer: Any, view: Batch) -> Batch:
    """A dataset step's ``rollout_log_probs``: its old log-probs (the policy's own)."""
    if is_dataset_step(view):
        return view.assign(tensors={"rollout_log_probs": view["old_log_probs"]})
    return view
