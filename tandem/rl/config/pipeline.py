"""What the asynchronous pipelines cannot do, checked against the whole run's config."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.rl.config.train import TrainConfig


def check_pipeline(config: TrainConfig) -> None:
    """Settings that cannot work with rollout replicas apart from the trainer (or, in sync mode,
    without them), named by key."""
    pipeline = config.pipeline
    if not pipeline.disaggregated:
        tp = config.rollout.engine.gpus_per_engine
        if tp > 1:
            raise ValueError(
                f"rollout.engine.vllm.tensor_parallel_size={tp} needs replicas of their own: pipeline.mode=sync "
                "runs each engine in a trainer worker, on that worker's one GPU; use pipeline.mode=one_step_off "
                "or fully_async"
            )
        return
    mode = f"pipeline.mode={pipeline.mode}"
    if config.rollout.free_cache_between_generations:
        raise ValueError(f"{mode} generates continuously; rollout.free_cache_between_generations must be off")
    offload = config.actor.offload
    if offload.params or offload.optimizer:
        key = "actor.offload.params" if offload.params else "actor.offload.optimizer"
        raise ValueError(
            f"{mode} generates on replicas of its own, so the trainer never waits on a generation; "
            f"{key} frees memory for a colocated rollout and must be off (actor.offload.reference may stay on)"
        )
    if pipeline.old_log_probs == "rollout" and config.algorithm.needs_sum_pi_squared:
        raise ValueError(
            f"algorithm.adv_estimator={config.algorithm.adv_estimator} needs sum_pi_squared from a trainer forward, "
            "which pipeline.old_log_probs=rollout skips; use pipeline.old_log_probs=recompute"
        )
    if pipeline.old_log_probs == "rollout" and (config.rollout.top_p < 1.0 or config.rollout.top_k):
        raise ValueError(
            f"pipeline.old_log_probs=rollout needs untruncated sampling (rollout.top_p=1, rollout.top_k=0; got "
            f"{config.rollout.top_p}, {config.rollout.top_k}): truncation changes the rollout's log-probs"
        )
    lag = pipeline.trigger_parameter_sync_step - 1
    if pipeline.mode == "fully_async" and pipeline.staleness_threshold < lag:
        raise ValueError(
            f"pipeline.staleness_threshold={pipeline.staleness_threshold} is below pipeline."
            f"trigger_parameter_sync_step - 1 = {lag}: between syncs the trainer would wait for samples "
            "that the threshold forbids the rollout to start"
        )
