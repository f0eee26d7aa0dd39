"""verl keys that only make sense together, each group translated by one function.

Every function reads a :class:`~tandem.verl.context.Context`: ``values`` (verl's defaults
overlaid with the command's keys) and ``given`` (the keys the command set), and writes tandem
settings (``out``) and notes. A combination tandem cannot reproduce is a ``ValueError`` naming
the verl keys. This module holds the settings verl moved between releases, the data and the
trainer's outputs, and :data:`TRANSLATORS`, every translator in the order they run; the others
live by concern: :mod:`.joint_algorithm`, :mod:`.joint_training`, :mod:`.joint_rollout`,
:mod:`.joint_rewards` and :mod:`.multi_turn`.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.data.file_lists import file_list
from tandem.verl import multi_turn, names
from tandem.verl.context import Context
from tandem.verl.joint_algorithm import (
    cispo_lower_clip,
    filter_groups,
    gdpo_normalisation,
    kl_estimator,
    policy_loss,
    rollout_correction,
)
from tandem.verl.joint_rewards import OVERLONG_PLACES, rewards
from tandem.verl.joint_rollout import rollout_engine, router_replay, validation_sampling
from tandem.verl.joint_training import (
    ACTOR_SP,
    REF_SP,
    data_plane,
    engine_settings,
    optimizer,
    sequence_parallel,
)
from tandem.verl.keys import ACTOR, MODEL

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
    ACTOR_SP,  # Ulysses: the actor's section, then its FSDP engine's
    REF_SP,
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
    """verl's file or list of files (read in order as one dataset) -> tandem's path or list
    (:func:`tandem.data.file_list` reads both)."""
    value = ctx.get(key)
    if value is None:
        return
    listed = isinstance(value, (list, tuple))
    files = file_list([str(path) for path in value] if listed else str(value), key)
    if listed and not files:
        raise ValueError(f"{key}: an empty list of files")
    ctx.out[to] = list(files) if len(files) > 1 else (files[0] if files else "")


def data_files(ctx: Context) -> None:
    """verl's training and validation files -> ``data.train_path`` / ``data.val_path``."""
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
    """verl's override of the model's position limit changes nothing here: one note."""
    key = f"{MODEL}.override_config.max_position_embeddings"
    if ctx.set_by_user(key):
        ctx.notes.append(
            f"{key}: a length limit in the model's config; tandem's rotary positions do not depend on it"
        )


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
    sequence_parallel,
    rollout_engine,
    router_replay,
    validation_sampling,
    rewards,
    trainer_outputs,
    data_plane,
    multi_turn.agent_loops,
)
