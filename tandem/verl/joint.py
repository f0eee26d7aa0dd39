"""verl keys that only make sense together, each group translated by one function.

Every function reads ``values`` (verl's defaults overlaid with the command's keys), ``given``
(the keys the command set) and returns ``(tandem settings, notes)``. A combination tandem
cannot reproduce is a ``ValueError`` naming the verl keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.device import cuda_device_count
from tandem.verl import names
from tandem.verl.keys import ACTOR, ALGO, MODEL, ROLLOUT


@dataclass
class Context:
    """What the joint translators read and write."""

    values: dict[str, Any]
    given: set[str]
    out: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def set_by_user(self, key: str) -> bool:
        return key in self.given


def _one_file(ctx: Context, key: str, to: str) -> None:
    value = ctx.get(key)
    if value is None:
        return
    files = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(files) != 1:
        raise ValueError(
            f"{key}: tandem reads one file per split, got {len(files)}; concatenate them into one parquet file"
        )
    ctx.out[to] = str(files[0])


def data_files(ctx: Context) -> None:
    _one_file(ctx, "data.train_files", "data.train_path")
    _one_file(ctx, "data.val_files", "data.val_path")


TRUNCATION = {
    "error": "error",
    "left": "truncate_left",
    "right": "truncate_right",
    "middle": "truncate_middle",
}


def overlong_prompts(ctx: Context) -> None:
    """verl drops overlong prompts when ``filter_overlong_prompts``; otherwise ``truncation`` decides."""
    if ctx.get("data.filter_overlong_prompts"):
        ctx.out["data.overlong_prompts"] = "filter"
        return
    truncation = ctx.get("data.truncation")
    if truncation not in TRUNCATION:
        raise ValueError(f"data.truncation={truncation}: choose one of {list(TRUNCATION)}")
    ctx.out["data.overlong_prompts"] = TRUNCATION[truncation]


def position_limit(ctx: Context) -> None:
    key = f"{MODEL}.override_config.max_position_embeddings"
    if ctx.set_by_user(key):
        ctx.notes.append(
            f"{key}: a length limit in the model's config; tandem's rotary positions do not depend on it"
        )


def optimizer(ctx: Context) -> None:
    """Gradient clipping (two verl keys), warmup (steps or a ratio) and the schedule's name."""
    clips = {k: ctx.get(k) for k in (f"{ACTOR}.optim.clip_grad", f"{ACTOR}.grad_clip") if ctx.set_by_user(k)}
    if len(set(clips.values())) > 1:
        raise ValueError(f"{' and '.join(clips)} disagree ({list(clips.values())}); set one")
    clip = next(iter(clips.values()), ctx.get(f"{ACTOR}.grad_clip"))
    ctx.out["actor.engine.grad_clip"] = None if clip is None or float(clip) <= 0 else float(clip)
    steps = ctx.get(f"{ACTOR}.optim.lr_warmup_steps")
    ratio = float(ctx.get(f"{ACTOR}.optim.lr_warmup_steps_ratio") or 0.0)
    if steps is not None and int(steps) >= 0:
        ctx.out["actor.engine.warmup_steps"] = int(steps)
    elif ratio > 0:
        raise ValueError(
            f"{ACTOR}.optim.lr_warmup_steps_ratio={ratio}: tandem counts warmup in optimizer steps; set "
            f"{ACTOR}.optim.lr_warmup_steps to ratio x the run's optimizer steps"
        )
    else:
        ctx.out["actor.engine.warmup_steps"] = 0
    ctx.out["actor.engine.warmup_from_zero"] = True  # verl's warmup starts at lr 0
    style = ctx.get(f"{ACTOR}.optim.warmup_style")
    schedule = style if style is not None else ctx.get(f"{ACTOR}.optim.lr_scheduler_type")
    ctx.out["actor.engine.lr_schedule"] = names.tandem_name(f"{ACTOR}.optim.lr_scheduler_type", schedule)


def dtypes(ctx: Context, on_gpu: bool) -> None:
    model_dtype = ctx.get(f"{ACTOR}.fsdp_config.model_dtype")
    params = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if model_dtype not in params:
        raise ValueError(f"{ACTOR}.fsdp_config.model_dtype={model_dtype}: tandem trains in fp32 or bf16")
    ctx.out["actor.engine.param_dtype"] = params[model_dtype]
    compute = ctx.get(f"{ACTOR}.fsdp_config.dtype")
    if compute in ("bfloat16", "bf16"):
        if on_gpu:
            ctx.out["actor.engine.mixed_precision"] = "bf16"
        else:
            ctx.out["actor.engine.mixed_precision"] = "none"
            ctx.notes.append(
                f"{ACTOR}.fsdp_config.dtype={compute}: verl computes in bf16 on GPUs; tandem on the CPU computes in fp32"
            )
    elif compute in ("float32", "fp32"):
        ctx.out["actor.engine.mixed_precision"] = "none"
    else:
        raise ValueError(f"{ACTOR}.fsdp_config.dtype={compute}: tandem computes in bf16 or fp32")


def micro_batches(ctx: Context, workers: int) -> None:
    """verl's micro-batches (sequences per GPU, or tokens per GPU with ``use_dynamic_bsz``) become
    tandem's packed token budget per worker. Micro-batches never change the result."""
    longest = int(ctx.get("data.max_prompt_length")) + int(ctx.get("data.max_response_length"))
    to = "actor.engine.max_tokens_per_micro_batch"
    if ctx.get(f"{ACTOR}.use_dynamic_bsz"):
        budget = int(ctx.get(f"{ACTOR}.ppo_max_token_len_per_gpu"))
        if budget < longest:
            raise ValueError(
                f"{ACTOR}.ppo_max_token_len_per_gpu={budget} is below the longest sequence, "
                f"data.max_prompt_length + data.max_response_length = {longest}"
            )
        ctx.out[to] = budget
        return
    per_gpu = ctx.get(f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    total = ctx.get(f"{ACTOR}.ppo_micro_batch_size")
    if per_gpu is not None and total is not None:
        raise ValueError(f"set one of {ACTOR}.ppo_micro_batch_size_per_gpu and {ACTOR}.ppo_micro_batch_size")
    if per_gpu is None and total is not None:
        per_gpu = max(1, int(total) // workers)
    if per_gpu is None:
        ctx.out[to] = max(4096, longest)
        ctx.notes.append(f"no micro-batch size given: {to}={ctx.out[to]} tokens per worker")
        return
    ctx.out[to] = int(per_gpu) * longest  # never more memory than per_gpu padded sequences


def policy_loss(ctx: Context) -> None:
    """The loss's name and the clip settings it reads (DPPO reads them as divergence bounds)."""
    mode = ctx.get(f"{ACTOR}.policy_loss.loss_mode")
    name = names.tandem_name(f"{ACTOR}.policy_loss.loss_mode", mode)
    ctx.out["actor.policy_loss.name"] = name
    clip = ctx.get(f"{ACTOR}.clip_ratio")
    low = ctx.get(f"{ACTOR}.clip_ratio_low", 0.2)
    high = ctx.get(f"{ACTOR}.clip_ratio_high", 0.2)
    low = float(clip if low is None else low)
    high = float(clip if high is None else high)
    if ctx.set_by_user(f"{ACTOR}.clip_ratio") and not (
        ctx.set_by_user(f"{ACTOR}.clip_ratio_low") or ctx.set_by_user(f"{ACTOR}.clip_ratio_high")
    ):
        ctx.notes.append(
            f"{ACTOR}.clip_ratio={clip}: verl's losses read clip_ratio_low/high ({low}, {high}) and use "
            "clip_ratio only where those are null; so does this translation"
        )
    cap = ctx.get(f"{ACTOR}.clip_ratio_c")
    if name.startswith("dppo_"):
        ctx.out["actor.policy_loss.dppo_divergence_low"] = low
        ctx.out["actor.policy_loss.dppo_divergence_high"] = high
        ctx.out["actor.policy_loss.dppo_ratio_cap"] = 20.0 if cap is None else float(cap)
    else:
        ctx.out["actor.policy_loss.clip_ratio_low"] = low
        ctx.out["actor.policy_loss.clip_ratio_high"] = high
        ctx.out["actor.policy_loss.clip_ratio_c"] = None if cap is None else float(cap)
    ctx.out["actor.policy_loss.loss_agg_mode"] = names.tandem_name(
        f"{ACTOR}.loss_agg_mode", ctx.get(f"{ACTOR}.loss_agg_mode")
    )
    for setting, value in VERL_LOSS_BEHAVIOUR.get(name, {}).items():
        ctx.out[f"actor.policy_loss.{setting}"] = value
    beta = ctx.get(f"{ACTOR}.policy_loss.dro_beta")
    if beta is not None:
        ctx.out["actor.policy_loss.dro_beta"] = float(beta)


# Settings that make a tandem loss compute verl's numbers where tandem differs on purpose
# (docs/algorithms.md, "Where tandem differs from verl"): verl's GSPO and SAPO average the policy
# term per sequence whatever loss_agg_mode says; its covariance losses, GMPO and GSPO's ppo_kl do
# not clamp log-ratios; its DPPO tests zero-advantage tokens against the lower bound; its GMPO
# takes the geometric mean of rollout-correction weights.
VERL_LOSS_BEHAVIOUR: dict[str, dict[str, Any]] = {
    "gspo": {"pg_loss_agg_mode": "seq-mean-token-mean", "log_ratio_clamp": None},
    "sapo": {"pg_loss_agg_mode": "seq-mean-token-mean"},
    "clip_cov": {"log_ratio_clamp": None},
    "kl_cov": {"log_ratio_clamp": None},
    "gmpo": {"log_ratio_clamp": None, "gmpo_is_weight_mean": "geometric"},
    "dppo_tv": {"dppo_zero_advantage_region": "negative"},
    "dppo_kl": {"dppo_zero_advantage_region": "negative"},
}


def kl_estimator(ctx: Context) -> None:
    """tandem has one KL estimator for both uses; verl has one per use."""
    loss_type = names.tandem_name(f"{ACTOR}.kl_loss_type", ctx.get(f"{ACTOR}.kl_loss_type"))
    penalty = names.tandem_name(f"{ALGO}.kl_penalty", ctx.get(f"{ALGO}.kl_penalty"))
    in_loss, in_reward = ctx.get(f"{ACTOR}.use_kl_loss"), ctx.get(f"{ALGO}.use_kl_in_reward")
    if in_loss and in_reward and loss_type != penalty:
        raise ValueError(
            f"{ACTOR}.kl_loss_type={ctx.get(f'{ACTOR}.kl_loss_type')} and {ALGO}.kl_penalty="
            f"{ctx.get(f'{ALGO}.kl_penalty')} differ; tandem uses one KL estimator for the loss and the "
            "reward penalty (algorithm.kl.estimator)"
        )
    ctx.out["algorithm.kl.estimator"] = penalty if in_reward and not in_loss else loss_type


def gdpo_normalisation(ctx: Context) -> None:
    """verl's trainer never passes ``norm_adv_by_std_in_grpo`` to GDPO: it always divides by the std."""
    if ctx.out.get("algorithm.adv_estimator") != "gdpo":
        return
    if ctx.set_by_user(f"{ALGO}.norm_adv_by_std_in_grpo") and not ctx.get(f"{ALGO}.norm_adv_by_std_in_grpo"):
        ctx.notes.append(
            f"{ALGO}.norm_adv_by_std_in_grpo=False: verl's GDPO divides by the std regardless; so does this translation"
        )
    ctx.out["algorithm.norm_adv_by_std"] = True


def filter_groups(ctx: Context) -> None:
    batches = int(ctx.get(f"{ALGO}.filter_groups.max_num_gen_batches") or 0)
    if ctx.get(f"{ALGO}.filter_groups.enable"):
        if batches <= 0:
            raise ValueError(
                f"{ALGO}.filter_groups.max_num_gen_batches={batches}: tandem needs a limit on generation rounds "
                "(verl's 0 means none); set a positive number"
            )
        ctx.out["algorithm.filter_groups.max_num_gen_batches"] = batches
    metric = ctx.get(f"{ALGO}.filter_groups.metric")
    metrics = {
        None: "score",
        "score": "score",
        "seq_reward": "score",
        "seq_final_reward": "score",
        "acc": "acc",
    }
    if metric not in metrics:
        raise ValueError(f"{ALGO}.filter_groups.metric={metric}: tandem filters on 'acc' or 'score'")
    ctx.out["algorithm.filter_groups.metric"] = metrics[metric]


def rollout_correction(ctx: Context) -> None:
    base = f"{ALGO}.rollout_correction"
    level = ctx.get(f"{base}.rollout_is")
    ctx.out["algorithm.rollout_correction.is_level"] = names.tandem_name(f"{base}.rollout_is", level)
    rejection = ctx.get(f"{base}.rollout_rs")
    ctx.out["algorithm.rollout_correction.rejection"] = names.tandem_name(f"{base}.rollout_rs", rejection)
    threshold = ctx.get(f"{base}.rollout_rs_threshold")
    if rejection is None or threshold is None:
        return
    text = str(threshold)
    low, _, high = text.partition("_")
    try:
        bounds = (float(low), float(high)) if high else (1.0 / float(low), float(low))
    except ValueError:
        raise ValueError(
            f"{base}.rollout_rs_threshold={threshold}: expected 'LOW_HIGH' or one upper bound"
        ) from None
    ctx.out["algorithm.rollout_correction.rejection_low"] = bounds[0]
    ctx.out["algorithm.rollout_correction.rejection_high"] = bounds[1]


def rollout_engine(ctx: Context) -> None:
    name = ctx.get(f"{ROLLOUT}.name")
    if name is None:
        raise ValueError(f"{ROLLOUT}.name is required (vllm, hf, or tandem's native)")
    engine = names.tandem_name(f"{ROLLOUT}.name", name)
    ctx.out["rollout.engine.name"] = engine
    vllm_only = {
        "gpu_memory_utilization": float,
        "enforce_eager": bool,
        "enable_prefix_caching": bool,
        "dtype": str,
    }
    for key, convert in vllm_only.items():
        if not ctx.set_by_user(f"{ROLLOUT}.{key}"):
            continue
        if engine == "vllm":
            ctx.out[f"rollout.engine.vllm.{key}"] = convert(ctx.get(f"{ROLLOUT}.{key}"))
        else:
            ctx.notes.append(f"{ROLLOUT}.{key}: a vLLM setting; the {engine} engine does not read it")
    if ctx.set_by_user(f"{ROLLOUT}.max_num_seqs") and engine in ("vllm", "native"):
        ctx.out[f"rollout.engine.{engine}.max_num_seqs"] = int(ctx.get(f"{ROLLOUT}.max_num_seqs"))
    mode = ctx.get(f"{ROLLOUT}.logprobs_mode")
    if mode not in ("processed_logprobs", "processed"):
        raise ValueError(
            f"{ROLLOUT}.logprobs_mode={mode}: tandem's trainer compares against processed log-probs "
            "(after temperature), so the rollout must return those"
        )


def validation_sampling(ctx: Context) -> None:
    base = f"{ROLLOUT}.val_kwargs"
    if ctx.get(f"{base}.do_sample"):
        temperature = float(ctx.get(f"{base}.temperature"))
        ctx.out["rollout.val_temperature"] = temperature
        ctx.out["rollout.val_n"] = int(ctx.get(f"{base}.n"))
        if temperature > 0:
            ctx.out["rollout.val_top_p"] = float(ctx.get(f"{base}.top_p"))
            top_k = ctx.get(f"{base}.top_k")
            ctx.out["rollout.val_top_k"] = 0 if top_k is None or int(top_k) < 0 else int(top_k)
        return
    ctx.out["rollout.val_temperature"] = 0.0
    ctx.out["rollout.val_n"] = 1
    if int(ctx.get(f"{base}.n")) != 1:
        ctx.notes.append(
            f"{base}.n={ctx.get(f'{base}.n')} with do_sample=false: greedy gives one answer per prompt"
        )


def rewards(ctx: Context) -> None:
    """The scoring function, verl's DAPO reward manager's overlong buffer, and the worker count."""
    for prefix in ("custom_reward_function", "reward.custom_reward_function"):
        path = ctx.get(f"{prefix}.path")
        if path is not None:
            ctx.out["reward.custom_path"] = str(path)
            name = ctx.get(f"{prefix}.name")
            ctx.out["reward.custom_name"] = "compute_score" if name is None else str(name)
    manager = ctx.get("reward.reward_manager.name", ctx.get("reward_model.reward_manager"))
    if manager not in (None, "naive", "dapo"):
        raise ValueError(
            f"reward manager {manager!r}: tandem scores like verl's 'naive' manager (and 'dapo' with an overlong "
            "buffer); use custom_reward_function for anything else"
        )
    for prefix in ("reward.reward_kwargs.overlong_buffer_cfg", "reward_model.overlong_buffer"):
        if ctx.get(f"{prefix}.enable") is None:
            continue
        if manager != "dapo":
            raise ValueError(
                f"{prefix}.enable applies to verl's 'dapo' reward manager; set the manager to dapo"
            )
        ctx.out["reward.overlong.enable"] = bool(ctx.get(f"{prefix}.enable"))
        for key, to, convert in (("len", "buffer", int), ("penalty_factor", "penalty_factor", float)):
            if ctx.get(f"{prefix}.{key}") is not None:
                ctx.out[f"reward.overlong.{to}"] = convert(ctx.get(f"{prefix}.{key}"))
    limit = ctx.get("reward.reward_kwargs.max_resp_len")
    if limit is not None and int(limit) != int(ctx.get("data.max_response_length")):
        raise ValueError(
            f"reward.reward_kwargs.max_resp_len={limit} differs from data.max_response_length="
            f"{ctx.get('data.max_response_length')}; tandem measures the overlong buffer from the latter"
        )
    for key in ("reward.num_workers", "reward_model.num_workers"):
        if ctx.get(key) is not None:
            ctx.out["reward.num_workers"] = int(ctx.get(key))


def critic(ctx: Context, estimator: str) -> None:
    keys = sorted(k for k in ctx.given if k.startswith("critic."))
    if keys and estimator != "gae":
        ctx.notes.append(f"{', '.join(keys)}: no critic runs for algorithm.adv_estimator={estimator}")
    # With gae, tandem's own config names the missing critic (algorithm.adv_estimator).


def placement(ctx: Context) -> tuple[int, bool]:
    """Devices and workers: ``(workers in all, on GPU)``. verl counts GPUs; on a machine without
    one (or with ``trainer.device=cpu``) each GPU becomes a CPU worker."""
    per_node = int(ctx.get("trainer.n_gpus_per_node"))
    nodes = int(ctx.get("trainer.nnodes"))
    device = ctx.get("trainer.device")
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"trainer.device={device}: tandem runs on cuda or cpu")
    on_gpu = device == "cuda" or (device is None and cuda_device_count() > 0)
    if on_gpu:
        ctx.out["trainer.device"] = "cuda"
        ctx.out["trainer.n_gpus_per_node"] = per_node
    else:
        ctx.out["trainer.device"] = "cpu"
        ctx.out["trainer.n_workers"] = per_node
        if device is None:
            ctx.notes.append(
                f"no GPU visible: trainer.n_gpus_per_node={per_node} becomes {per_node} CPU workers"
            )
    ctx.out["trainer.nnodes"] = nodes
    if nodes > 1:
        ctx.out["trainer.backend"] = "ray"
    return per_node * nodes, on_gpu


def trainer_outputs(ctx: Context) -> None:
    """Loggers (tandem always writes metrics.jsonl, which its report draws), output directory, resume."""
    loggers = ctx.get("trainer.logger")
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    mapped = [names.tandem_name("trainer.logger", name) for name in loggers]
    ctx.out["trainer.loggers"] = tuple(dict.fromkeys([*mapped, "jsonl"]))
    directory = ctx.get("trainer.default_local_dir")
    if directory is None:  # verl's default: checkpoints/${trainer.project_name}/${trainer.experiment_name}
        directory = f"checkpoints/{ctx.get('trainer.project_name')}/{ctx.get('trainer.experiment_name')}"
    ctx.out["trainer.output_dir"] = str(directory)
    mode = ctx.get("trainer.resume_mode")
    if mode == "resume_path":
        path = ctx.get("trainer.resume_from_path")
        if not path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        ctx.out["trainer.resume"] = str(path)
    elif mode in ("auto", "disable"):
        ctx.out["trainer.resume"] = mode
    else:
        raise ValueError(f"trainer.resume_mode={mode}: choose auto, disable or resume_path")


TRANSLATORS: tuple[Callable[[Context], None], ...] = (
    data_files,
    overlong_prompts,
    position_limit,
    optimizer,
    policy_loss,
    kl_estimator,
    gdpo_normalisation,
    filter_groups,
    rollout_correction,
    rollout_engine,
    validation_sampling,
    rewards,
    trainer_outputs,
)
