"""verl keys that only make sense together, each group translated by one function.

Every function reads ``values`` (verl's defaults overlaid with the command's keys), ``given``
(the keys the command set) and returns ``(tandem settings, notes)``. A combination tandem
cannot reproduce is a ``ValueError`` naming the verl keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.device import cuda_device_count
from tandem.verl import multi_turn, names
from tandem.verl.keys import ACTOR, ALGO, MODEL, REF, ROLLOUT


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


# DAPO's overlong buffer: verl 0.8+ reads reward.reward_kwargs; older scripts set reward_model.reward_kwargs
# (verl 0.9 still copies it over) or, older still, reward_model.overlong_buffer.
OVERLONG_PLACES = (
    "reward.reward_kwargs.overlong_buffer_cfg",
    "reward_model.reward_kwargs.overlong_buffer_cfg",
    "reward_model.overlong_buffer",
)

# Settings verl moved between releases: each tuple holds one setting's places (a key, or a group
# whose keys end alike). A script may give any of them, and gives each setting one value.
MOVED: tuple[tuple[str, ...], ...] = (
    ("reward.reward_kwargs", "reward_model.reward_kwargs"),
    OVERLONG_PLACES,
    ("reward.reward_manager.name", "reward_model.reward_manager"),
    ("reward.custom_reward_function", "custom_reward_function"),
    ("reward.num_workers", "reward_model.num_workers"),
    *(  # the learning-rate schedule: current, older FSDP and Megatron names
        tuple(f"{role}.optim.{name}" for name in ("lr_scheduler_type", "warmup_style", "lr_decay_style"))
        for role in (ACTOR, "critic")
    ),
    (f"{MODEL}.lora_rank", f"{MODEL}.lora.rank"),  # FSDP's and Megatron's LoRA
    (f"{MODEL}.lora_alpha", f"{MODEL}.lora.alpha"),
)


def moved_keys(ctx: Context) -> None:
    """A setting given at two of its places (:data:`MOVED`) must have one value there."""
    for places in MOVED:
        first: dict[str, str] = {}  # the rest of a key after its place -> the first key given
        for key in sorted(ctx.given):
            place = next((p for p in places if key == p or key.startswith(f"{p}.")), None)
            if place is None:
                continue
            twin = first.setdefault(key[len(place) :], key)
            if ctx.get(twin) != ctx.get(key):
                raise ValueError(
                    f"{key}={ctx.get(key)} and {twin}={ctx.get(twin)}: the same verl setting at two of its "
                    "places (verl moved it between releases) with two values; keep one"
                )


def _files(ctx: Context, key: str, to: str) -> None:
    """verl's file or list of files (read in order as one dataset) -> tandem's path or list."""
    value = ctx.get(key)
    if value is None:
        return
    files = [str(path) for path in value] if isinstance(value, (list, tuple)) else [str(value)]
    if not files:
        raise ValueError(f"{key}: an empty list of files")
    ctx.out[to] = files[0] if len(files) == 1 else files


def data_files(ctx: Context) -> None:
    _files(ctx, "data.train_files", "data.train_path")
    _files(ctx, "data.val_files", "data.val_path")


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


def optimizer(ctx: Context, verl: str = ACTOR, tandem: str = "actor.engine") -> None:
    """The optimizer of one role (``verl``: its verl group, ``tandem``: its engine's keys): gradient
    clipping, warmup (steps, or a ratio of the schedule), the schedule's name, verl's warmup shape.

    verl steps the schedule once per RL step (``trainer.lr_schedule_unit=step``). Its v1 trainer
    (``trainer.use_v1``, the default) clips by ``optim.clip_grad``; the legacy one by ``grad_clip``.
    """
    read, ignored = (f"{verl}.optim.clip_grad", f"{verl}.grad_clip")
    if not ctx.get("trainer.use_v1"):
        read, ignored = ignored, read
    if ctx.set_by_user(ignored):
        version = "v1 trainer" if ctx.get("trainer.use_v1") else "legacy trainer (trainer.use_v1=False)"
        ctx.notes.append(f"{ignored}: verl's {version} clips by {read}; so does this translation")
    clip = ctx.get(read)
    ctx.out[f"{tandem}.grad_clip"] = None if clip is None or float(clip) <= 0 else float(clip)
    steps = ctx.get(f"{verl}.optim.lr_warmup_steps")
    if steps is not None and int(steps) > 0:
        ctx.out[f"{tandem}.warmup_steps"] = int(steps)
    else:  # verl: a non-positive (or null) lr_warmup_steps defers to the ratio
        ctx.out[f"{tandem}.warmup_steps"] = 0
        ctx.out[f"{tandem}.warmup_ratio"] = float(ctx.get(f"{verl}.optim.lr_warmup_steps_ratio") or 0.0)
    ctx.out[f"{tandem}.warmup_from_zero"] = True  # verl's warmup starts at lr 0
    ctx.out["trainer.lr_schedule_unit"] = "step"
    # verl's older FSDP name (warmup_style), then Megatron's (lr_decay_style, min_lr), then the current one
    styles = (
        ctx.get(f"{verl}.optim.{name}") for name in ("warmup_style", "lr_decay_style", "lr_scheduler_type")
    )
    schedule = next((style for style in styles if style is not None), None)
    ctx.out[f"{tandem}.lr_schedule"] = names.tandem_name(f"{ACTOR}.optim.lr_scheduler_type", schedule)
    min_lr, ratio_key = ctx.get(f"{verl}.optim.min_lr"), f"{verl}.optim.min_lr_ratio"
    if min_lr is not None:
        ratio = float(min_lr) / float(ctx.get(f"{verl}.optim.lr"))
        if ctx.set_by_user(ratio_key) and not math.isclose(float(ctx.get(ratio_key) or 0.0), ratio):
            raise ValueError(
                f"{verl}.optim.min_lr={min_lr} (a ratio of {ratio:g} to optim.lr) and {ratio_key}="
                f"{ctx.get(ratio_key)}: Megatron's and FSDP's name for one setting with two values; keep one"
            )
        ctx.out[f"{tandem}.min_lr_ratio"] = ratio


def dtypes(ctx: Context, on_gpu: bool) -> None:
    """Parameter and compute dtypes (the critic computes like the actor)."""
    model_dtype = ctx.get(f"{ACTOR}.fsdp_config.model_dtype")
    params = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
    if model_dtype not in params:
        raise ValueError(f"{ACTOR}.fsdp_config.model_dtype={model_dtype}: tandem trains in fp32 or bf16")
    ctx.out["actor.engine.param_dtype"] = params[model_dtype]
    compute = ctx.get(f"{ACTOR}.fsdp_config.dtype")
    if compute in ("bfloat16", "bf16"):
        precision = "bf16" if on_gpu else "none"
        if not on_gpu:
            ctx.notes.append(
                f"{ACTOR}.fsdp_config.dtype={compute}: verl computes in bf16 on GPUs; tandem on the CPU computes in fp32"
            )
    elif compute in ("float32", "fp32"):
        precision = "none"
    else:
        raise ValueError(f"{ACTOR}.fsdp_config.dtype={compute}: tandem computes in bf16 or fp32")
    ctx.out["actor.engine.mixed_precision"] = precision
    if ctx.out.get("algorithm.adv_estimator") == "gae":
        ctx.out["critic.engine.mixed_precision"] = precision
        ctx.out["critic.engine.param_dtype"] = params[model_dtype]


def micro_batches(ctx: Context, workers: int, verl: str = ACTOR, tandem: str = "actor.engine") -> None:
    """verl's micro-batches (sequences per GPU, or tokens per GPU with ``use_dynamic_bsz``) become
    tandem's packed token budget per worker. Micro-batches never change the result. As in verl,
    the critic's ``use_dynamic_bsz`` defaults to the actor's; its sizes are its own."""

    def read(name: str) -> Any:
        own = ctx.get(f"{verl}.{name}")
        inherited = own is None and verl != ACTOR and name == "use_dynamic_bsz"
        return ctx.get(f"{ACTOR}.{name}") if inherited else own

    longest = int(ctx.get("data.max_prompt_length")) + int(ctx.get("data.max_response_length"))
    to = f"{tandem}.max_tokens_per_micro_batch"
    if read("use_dynamic_bsz"):
        budget = int(ctx.get(f"{verl}.ppo_max_token_len_per_gpu"))
        if budget < longest:
            raise ValueError(
                f"{verl}.ppo_max_token_len_per_gpu={budget} is below the longest sequence, "
                f"data.max_prompt_length + data.max_response_length = {longest}"
            )
        ctx.out[to] = budget
        return
    per_gpu = read("ppo_micro_batch_size_per_gpu")
    total = read("ppo_micro_batch_size")
    if per_gpu is not None and total is not None:
        raise ValueError(f"set one of {verl}.ppo_micro_batch_size_per_gpu and {verl}.ppo_micro_batch_size")
    if per_gpu is None and total is not None:
        per_gpu = max(1, int(total) // workers)
    if per_gpu is None:
        ctx.out[to] = max(4096, longest)
        ctx.notes.append(f"no micro-batch size given: {to}={ctx.out[to]} tokens per worker")
        return
    ctx.out[to] = int(per_gpu) * longest  # never more memory than per_gpu padded sequences


CRITIC_INHERITS = ("ppo_mini_batch_size", "ppo_epochs", "loss_agg_mode")  # verl: the actor's unless set


def critic(ctx: Context, workers: int) -> None:
    """The critic's settings when the estimator reads values (``gae``); otherwise its keys change
    nothing and get one note."""
    keys = sorted(k for k in ctx.given if k.startswith("critic.") or k == "trainer.critic_warmup")
    estimator = ctx.out["algorithm.adv_estimator"]
    if estimator != "gae":
        if keys:
            ctx.notes.append(f"{', '.join(keys)}: no critic runs for algorithm.adv_estimator={estimator}")
        return
    if ctx.get("critic.model.path") is not None:
        ctx.out["critic.model_path"] = str(ctx.get("critic.model.path"))
    ctx.out["critic.engine.lr"] = float(ctx.get("critic.optim.lr"))
    ctx.out["critic.engine.weight_decay"] = float(ctx.get("critic.optim.weight_decay"))
    ctx.out["critic.engine.betas"] = tuple(float(b) for b in ctx.get("critic.optim.betas"))
    ctx.out["critic.engine.min_lr_ratio"] = float(ctx.get("critic.optim.min_lr_ratio") or 0.0)
    ctx.out["critic.engine.gradient_checkpointing"] = bool(
        ctx.get("critic.model.enable_gradient_checkpointing")
    )
    ctx.out["critic.offload.params"] = bool(ctx.get("critic.model.fsdp_config.param_offload"))
    ctx.out["critic.offload.optimizer"] = bool(ctx.get("critic.model.fsdp_config.optimizer_offload"))
    optimizer(ctx, "critic", "critic.engine")
    micro_batches(ctx, workers, "critic", "critic.engine")
    for name in CRITIC_INHERITS:
        value = ctx.get(f"critic.{name}")
        if value is not None:
            ctx.out[f"critic.{name}"] = value if name == "loss_agg_mode" else int(value)
    clip = ctx.get("critic.cliprange_value")
    ctx.out["critic.cliprange_value"] = None if clip is None else float(clip)
    # verl updates the actor once global_step (from 1) reaches critic_warmup: k - 1 critic-only steps
    ctx.out["critic.warmup_steps"] = max(0, int(ctx.get("trainer.critic_warmup") or 0) - 1)
    # verl fuses the roles that share a resource pool (one pool by default) into one process per rank
    ctx.out["critic.placement"] = "colocated"
    if ctx.get("critic.shuffle") is None and ctx.get(f"{ACTOR}.shuffle"):
        raise ValueError(
            f"{ACTOR}.shuffle=True also shuffles verl's critic mini-batches (critic.shuffle follows it); "
            "tandem's critic does not shuffle: set critic.shuffle=False"
        )


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
    behaviour = VERL_LOSS_BEHAVIOUR.get(name)
    for setting, value in (behaviour.settings if behaviour else {}).items():
        ctx.out[f"actor.policy_loss.{setting}"] = value
    beta = ctx.get(f"{ACTOR}.policy_loss.dro_beta")
    if beta is not None:
        ctx.out["actor.policy_loss.dro_beta"] = float(beta)


VERL_VERSION = "0.9.1"  # the verl release the translation reproduces (docs/migrating-from-verl.md)


@dataclass(frozen=True)
class VerlBehaviour:
    """Settings that make one tandem loss compute verl's numbers where tandem differs on purpose
    (docs/algorithms.md, "Where tandem differs from verl").

    Attributes:
        settings: ``actor.policy_loss.*`` values (without the prefix).
        verl: the verl release whose ``core_algos.py`` these settings were checked against.
        why: what verl does that the settings reproduce.
    """

    settings: dict[str, Any]
    verl: str
    why: str


VERL_LOSS_BEHAVIOUR: dict[str, VerlBehaviour] = {
    # GSPO aggregates by loss_agg_mode from verl 0.9.1 on; up to 0.9.0 it forced seq-mean-token-mean.
    "gspo": VerlBehaviour({"log_ratio_clamp": None}, "0.9.1", "ppo_kl from the unclamped log-ratio"),
    "sapo": VerlBehaviour(
        {"pg_loss_agg_mode": "seq-mean-token-mean"},
        "0.9.1",
        "the policy term is seq-mean-token-mean whatever loss_agg_mode says",
    ),
    "clip_cov": VerlBehaviour({"log_ratio_clamp": None}, "0.9.1", "the log-ratio is never clamped"),
    "kl_cov": VerlBehaviour({"log_ratio_clamp": None}, "0.9.1", "the log-ratio is never clamped"),
    "gmpo": VerlBehaviour(
        {"log_ratio_clamp": None, "gmpo_is_weight_mean": "geometric"},
        "0.9.1",
        "no log-ratio clamp; one rollout-correction weight per sequence, their geometric mean",
    ),
    "dppo_tv": VerlBehaviour(
        {"dppo_zero_advantage_region": "negative"}, "0.9.1", "A = 0 is tested against the lower bound"
    ),
    "dppo_kl": VerlBehaviour(
        {"dppo_zero_advantage_region": "negative"}, "0.9.1", "A = 0 is tested against the lower bound"
    ),
}


def cispo_lower_clip(ctx: Context) -> None:
    """CISPO clips the ratio to ``[1 - low, 1 + high]``; a ratio is positive, so any ``low >= 1``
    (verl's CISPO example sets 10) never binds and equals tandem's largest allowed value, 1."""
    low = ctx.out.get("actor.policy_loss.clip_ratio_low")
    if ctx.out.get("actor.policy_loss.name") == "cispo" and low is not None and low > 1.0:
        ctx.out["actor.policy_loss.clip_ratio_low"] = 1.0
        ctx.notes.append(
            f"{ACTOR}.clip_ratio_low={low}: CISPO's lower bound 1 - {low} never binds on a positive ratio; "
            "tandem writes the same as clip_ratio_low=1.0"
        )


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
    """DAPO's dynamic sampling. verl's v1 trainer reads the metric from the reward function's
    fields (``score`` before the overlong penalty, ``acc``) and generates until the batch is full."""
    if not ctx.get(f"{ALGO}.filter_groups.enable"):
        return
    metric = ctx.get(f"{ALGO}.filter_groups.metric")
    metrics = {"acc": "acc", "score": "raw_score"}
    if metric not in metrics:
        raise ValueError(
            f"{ALGO}.filter_groups.metric={metric}: verl's trainer reads 'acc' or 'score' from the reward "
            "function's fields; set one"
        )
    ctx.out["algorithm.filter_groups.metric"] = metrics[metric]
    batches = int(ctx.get(f"{ALGO}.filter_groups.max_num_gen_batches") or 0)
    if batches <= 0:
        batches = UNLIMITED_ROUNDS
        ctx.notes.append(
            f"{ALGO}.filter_groups.max_num_gen_batches=0: verl generates until the batch is full; tandem "
            f"allows {UNLIMITED_ROUNDS} rounds"
        )
    ctx.out["algorithm.filter_groups.max_num_gen_batches"] = batches


UNLIMITED_ROUNDS = 1000


def rollout_correction(ctx: Context) -> None:
    base = f"{ALGO}.rollout_correction"
    level = ctx.get(f"{base}.rollout_is")
    ctx.out["algorithm.rollout_correction.is_level"] = names.tandem_name(f"{base}.rollout_is", level)
    rejection = ctx.get(f"{base}.rollout_rs")
    ctx.out["algorithm.rollout_correction.rejection"] = names.tandem_name(f"{base}.rollout_rs", rejection)
    threshold = ctx.get(f"{base}.rollout_rs_threshold")
    if rejection is None:
        return
    if threshold is None:
        raise ValueError(
            f"{base}.rollout_rs={rejection} needs {base}.rollout_rs_threshold (verl requires one too)"
        )
    low, _, high = str(threshold).partition("_")
    try:
        lower, upper = (float(low), float(high)) if high else (1.0 / float(low), float(low))
    except ValueError:
        raise ValueError(
            f"{base}.rollout_rs_threshold={threshold}: expected 'LOW_HIGH' or one upper bound"
        ) from None
    # verl bounds -log(rho) by [log LOW, log HIGH]: rho = pi_old / pi_rollout lies in [1/HIGH, 1/LOW]
    ctx.out["algorithm.rollout_correction.rejection_low"] = 1.0 / upper
    ctx.out["algorithm.rollout_correction.rejection_high"] = 1.0 / lower


# The training strategies verl 0.9.1 has (its actor configs); another name is a typo. tandem trains
# with its own engine whichever is named (DDP or FSDP2, by the number of workers).
VERL_STRATEGIES = ("fsdp", "fsdp2", "megatron", "veomni", "torchtitan")
STRATEGY_KEYS: dict[str, tuple[str, ...]] = {
    f"{ACTOR}.strategy": VERL_STRATEGIES,
    f"{REF}.strategy": VERL_STRATEGIES,
    "critic.strategy": VERL_STRATEGIES,
    f"{ACTOR}.fsdp_config.strategy": ("fsdp", "fsdp2"),  # which FSDP: its engine's own choice
}


def engine_settings(ctx: Context) -> None:
    """verl's engine choices that change nothing here must still be values verl has: a strategy verl
    names, a parallel size that is a positive integer (sizes tandem lacks are refused in the key
    table). A typo is an error naming the key, not a note."""
    for key, allowed in STRATEGY_KEYS.items():
        if ctx.set_by_user(key) and ctx.get(key) not in allowed:
            raise ValueError(f"{key}={ctx.get(key)}: verl's strategies here are {', '.join(allowed)}")
    for key in sorted(ctx.given):
        value = ctx.get(key)
        if key.endswith("parallel_size") and (type(value) is not int or value < 1):
            raise ValueError(f"{key}={value}: a parallel size is a positive integer")


def rollout_engine(ctx: Context) -> None:
    name = ctx.get(f"{ROLLOUT}.name")
    if name is None:
        raise ValueError(f"{ROLLOUT}.name is required (vllm, hf, or tandem's native)")
    engine = names.tandem_name(f"{ROLLOUT}.name", name)
    ctx.out["rollout.engine.name"] = engine
    vllm_settings = {
        "gpu_memory_utilization": float,
        "enforce_eager": bool,
        "enable_prefix_caching": bool,
        "dtype": str,
    }
    # The same intent in the other engines' own settings: (their field, the value from verl's).
    own = {
        "native": {"dtype": ("dtype", str), "enforce_eager": ("cuda_graphs", lambda eager: not bool(eager))},
        "hf": {"dtype": ("dtype", str)},
    }
    for key, convert in vllm_settings.items():
        if not ctx.set_by_user(f"{ROLLOUT}.{key}"):
            continue
        value = ctx.get(f"{ROLLOUT}.{key}")
        if engine == "vllm":
            ctx.out[f"rollout.engine.vllm.{key}"] = convert(value)
        elif key in own.get(engine, {}):
            field, translate_value = own[engine][key]
            ctx.out[f"rollout.engine.{engine}.{field}"] = translate_value(value)
        else:
            ctx.notes.append(f"{ROLLOUT}.{key}: a vLLM setting; the {engine} engine does not read it")
    if ctx.set_by_user(f"{ROLLOUT}.max_num_seqs"):
        if engine in ("vllm", "native"):
            ctx.out[f"rollout.engine.{engine}.max_num_seqs"] = int(ctx.get(f"{ROLLOUT}.max_num_seqs"))
        else:
            ctx.notes.append(f"{ROLLOUT}.max_num_seqs: the {engine} engine generates one request at a time")
    mode = ctx.get(f"{ROLLOUT}.logprobs_mode")
    if mode not in ("processed_logprobs", "processed"):
        raise ValueError(
            f"{ROLLOUT}.logprobs_mode={mode}: tandem's trainer compares against processed log-probs "
            "(after temperature), so the rollout must return those"
        )


def validation_sampling(ctx: Context) -> None:
    """verl's agent loop samples validation with ``val_kwargs.temperature/top_p/top_k/n`` as given
    (``do_sample`` is not read); temperature 0 is greedy, one answer per prompt."""
    base = f"{ROLLOUT}.val_kwargs"
    if ctx.set_by_user(f"{base}.do_sample"):
        ctx.notes.append(
            f"{base}.do_sample: verl samples validation by val_kwargs.temperature; so does tandem"
        )
    temperature = float(ctx.get(f"{base}.temperature"))
    ctx.out["rollout.val_temperature"] = temperature
    n = int(ctx.get(f"{base}.n"))
    if temperature == 0.0:
        if n != 1:
            ctx.notes.append(f"{base}.n={n} at temperature 0: greedy gives one answer per prompt (val_n=1)")
        ctx.out["rollout.val_n"] = 1
        return
    ctx.out["rollout.val_n"] = n
    ctx.out["rollout.val_top_p"] = float(ctx.get(f"{base}.top_p"))
    top_k = ctx.get(f"{base}.top_k")
    ctx.out["rollout.val_top_k"] = 0 if top_k is None or int(top_k) < 0 else int(top_k)


def rewards(ctx: Context) -> None:
    """The scoring function, verl's DAPO reward manager's overlong buffer, and the worker count."""
    for prefix in ("custom_reward_function", "reward.custom_reward_function"):
        path = ctx.get(f"{prefix}.path")
        if path is not None:
            ctx.out["reward.custom_path"] = str(path)
            name = ctx.get(f"{prefix}.name")
            ctx.out["reward.custom_name"] = "compute_score" if name is None else str(name)
    manager = ctx.get("reward.reward_manager.name", ctx.get("reward_model.reward_manager"))
    if manager not in (None, "naive", "dapo", "gdpo"):
        raise ValueError(
            f"reward manager {manager!r}: tandem scores like verl's 'naive' (and 'gdpo') manager, and 'dapo' with "
            "an overlong buffer; use custom_reward_function for anything else"
        )
    for prefix in OVERLONG_PLACES:
        given = [k for k in ("enable", "len", "penalty_factor") if ctx.get(f"{prefix}.{k}") is not None]
        if not given:
            continue
        if manager != "dapo":
            raise ValueError(f"{prefix}.* applies to verl's 'dapo' reward manager; set the manager to dapo")
        if not ctx.get(f"{prefix}.enable"):
            if given != ["enable"]:
                ctx.notes.append(f"{prefix}.{', '.join(given)}: the overlong buffer is off ({prefix}.enable)")
            ctx.out["reward.overlong.enable"] = False
            continue
        if ctx.get(f"{prefix}.len") is None:
            raise ValueError(f"{prefix}.enable=True needs {prefix}.len (verl asserts it too)")
        ctx.out["reward.overlong.enable"] = True
        ctx.out["reward.overlong.buffer"] = int(ctx.get(f"{prefix}.len"))
        factor = ctx.get(f"{prefix}.penalty_factor")
        ctx.out["reward.overlong.penalty_factor"] = 1.0 if factor is None else float(factor)
    for key in ("reward.reward_kwargs.max_resp_len", "reward_model.reward_kwargs.max_resp_len"):
        limit = ctx.get(key)
        if limit is not None and int(limit) != int(ctx.get("data.max_response_length")):
            raise ValueError(
                f"{key}={limit} differs from data.max_response_length="
                f"{ctx.get('data.max_response_length')}; tandem measures the overlong buffer from the latter"
            )
    for prefix, path_key in (("reward_model", "model.path"), ("reward.reward_model", "model_path")):
        if not ctx.get(f"{prefix}.enable"):
            continue
        path = ctx.get(f"{prefix}.{path_key}")
        if path is None:
            raise ValueError(f"{prefix}.enable=True needs {prefix}.{path_key} (a reward model directory)")
        ctx.out["reward.sources"] = (
            "model",
        )  # verl's reward manager returns rm_scores in place of the rule's
        ctx.out["reward.model.path"] = str(path)
        if ctx.get(f"{prefix}.max_length") is not None:
            ctx.out["reward.model.max_length"] = int(ctx.get(f"{prefix}.max_length"))
    for key in ("reward.num_workers", "reward_model.num_workers"):
        if ctx.get(key) is not None:
            ctx.out["reward.num_workers"] = int(ctx.get(key))


def placement(ctx: Context) -> tuple[int, bool]:
    """Devices and workers: ``(workers in all, on GPU)``. verl counts GPUs; on one machine without
    one (or with ``trainer.device=cpu``) each GPU becomes a CPU worker. Several nodes keep their
    GPUs whatever this machine has: the Ray cluster's nodes hold them, and a head node without
    GPUs is common (the capacity check refuses a cluster that has none)."""
    per_node = int(ctx.get("trainer.n_gpus_per_node"))
    nodes = int(ctx.get("trainer.nnodes"))
    device = ctx.get("trainer.device")
    if device not in (None, "cuda", "cpu"):
        raise ValueError(f"trainer.device={device}: tandem runs on cuda or cpu")
    local_gpus = cuda_device_count()
    on_gpu = device == "cuda" or (device is None and (local_gpus > 0 or nodes > 1))
    if on_gpu:
        ctx.out["trainer.device"] = "cuda"
        ctx.out["trainer.n_gpus_per_node"] = per_node
        if device is None and not local_gpus:
            ctx.notes.append(
                f"trainer.nnodes={nodes}: the GPUs are the Ray cluster's (this machine sees none); "
                "trainer.device=cpu runs CPU workers instead"
            )
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
    moved_keys,
    data_files,
    overlong_prompts,
    position_limit,
    optimizer,
    policy_loss,
    cispo_lower_clip,
    kl_estimator,
    gdpo_normalisation,
    filter_groups,
    rollout_correction,
    engine_settings,
    rollout_engine,
    validation_sampling,
    rewards,
    trainer_outputs,
    multi_turn.agent_loops,
)
