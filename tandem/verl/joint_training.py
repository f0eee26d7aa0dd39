"""verl's training keys that only make sense together: each role's optimizer and micro-batches,
the dtypes, the critic, the engine choices that change nothing here, and the placement."""

from __future__ import annotations

import math
from typing import Any

from tandem.device import cuda_device_count
from tandem.verl import names
from tandem.verl.context import Context
from tandem.verl.keys import ACTOR, REF


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


# The training strategies verl 0.9.1 has (its actor configs); another name is a typo. tandem trains
# with its own engine whichever is named (DDP or FSDP2, by the number of workers).
VERL_STRATEGIES = ("fsdp", "fsdp2", "megatron", "veomni", "torchtitan")


# verl's Ulysses sizes, each role's at its two places (verl moved them between releases)
ACTOR_SP = (f"{ACTOR}.ulysses_sequence_parallel_size", f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size")
REF_SP = (f"{REF}.ulysses_sequence_parallel_size", f"{REF}.fsdp_config.ulysses_sequence_parallel_size")
CRITIC_SP = "critic.ulysses_sequence_parallel_size"


def sequence_parallel(ctx: Context) -> None:
    """verl's Ulysses sequence-parallel sizes -> ``actor.engine.sp_size`` and ``critic.engine.sp_size``.

    tandem's reference model runs in the actor's workers, split as the actor is: a reference size
    other than the actor's is refused (verl's default gives the reference the actor's)."""
    given = [key for key in ACTOR_SP if ctx.get(key) is not None]
    actor = int(ctx.get(given[0])) if given else 1
    if given:
        ctx.out["actor.engine.sp_size"] = actor
    for key in REF_SP:
        value = ctx.get(key)
        if ctx.set_by_user(key) and value is not None and int(value) != actor:
            raise ValueError(
                f"{key}={value} with an actor sequence-parallel size of {actor}: tandem's reference model runs "
                "in the actor's workers with actor.engine.sp_size; give the reference the actor's size"
            )
    if ctx.get(CRITIC_SP) is not None:
        ctx.out["critic.engine.sp_size"] = int(ctx.get(CRITIC_SP))


# verl's engines built on Megatron-LM: their parallelism (pipeline, Megatron's tensor and context
# parallelism) has no stand-in here, so a command naming one is refused rather than run as FSDP2.
MEGATRON_ENGINES = ("megatron", "mindspeed")
ENGINE_KEYS = ("model_engine", f"{ACTOR}.model_engine")

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
    for key in (*STRATEGY_KEYS, *ENGINE_KEYS):
        if ctx.set_by_user(key) and ctx.get(key) in MEGATRON_ENGINES:
            raise ValueError(
                f"{key}={ctx.get(key)}: tandem has no Megatron-LM engine and does not stand another in for it; "
                "the nearest is FSDP2 (strategy fsdp2) with actor.engine.sp_size for long sequences "
                "(docs/parallelism.md)"
            )
    for key in sorted(ctx.given):
        value = ctx.get(key)
        if key.endswith("parallel_size") and (type(value) is not int or value < 1):
            raise ValueError(f"{key}={value}: a parallel size is a positive integer")


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


def data_plane(ctx: Context) -> None:
    """verl's transfer queue -> tandem's data plane (docs/data-plane.md): with
    ``transfer_queue.enable`` per-token data stays where it was made (``dataplane.enabled``, also
    tandem's default), in shared-memory files on one node and in Ray's object store across several
    (``trainer.nnodes > 1``, which runs on ``trainer.backend=ray``: :func:`placement`; with or
    without the transfer queue, since the default data plane's shared memory is one host's)."""
    if ctx.get("transfer_queue.enable"):
        ctx.out["dataplane.enabled"] = True
    if int(ctx.get("trainer.nnodes")) > 1:
        ctx.out["dataplane.engine"] = "ray"
