"""``translate``: a verl command line's ``key=value`` items -> tandem overrides, notes and a ``TrainConfig``.

Steps: parse the items with Hydra's own override grammar (verl's command lines are Hydra
overrides, ``+key=`` and quoting included); check every key against the table in
:mod:`tandem.verl.keys` (an unknown key, or a feature tandem lacks, is an error naming it);
overlay the command on verl's defaults; translate mapped keys one by one and joint groups
with :mod:`tandem.verl.joint`; render tandem overrides that :func:`load_train_config` composes.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

from tandem.rl.config import TrainConfig
from tandem.rl.config_loader import load_train_config
from tandem.verl import joint, joint_training
from tandem.verl.context import Context
from tandem.verl.keys import BY_KEY, DEFAULTS, RULES, Rule

BASE_PRESET = "grpo"  # every key the preset sets is also set by the translation, from verl's values

# Families of verl keys that configure things tandem does itself (profilers, Ray start-up):
# every key under them is accepted with this note.
NOTED_PREFIXES: dict[str, str] = {
    "ray_kwargs.": "tandem starts Ray itself (trainer.backend=ray)",
    "global_profiler.": "use trainer.profile_steps (tandem's PyTorch profiler)",
    "actor_rollout_ref.actor.profiler.": "use trainer.profile_steps (tandem's PyTorch profiler)",
    "actor_rollout_ref.ref.profiler.": "use trainer.profile_steps (tandem's PyTorch profiler)",
    "actor_rollout_ref.rollout.profiler.": "use trainer.profile_steps (tandem's PyTorch profiler)",
    "actor_rollout_ref.rollout.engine_kwargs.": "engine arguments tandem's vLLM replica sets itself",
    "critic.fsdp.": "FSDP settings: tandem decides sharding and offloading itself",
    "critic.model.fsdp_config.": "FSDP settings: tandem decides sharding and offloading itself",
    "critic.checkpoint.": "tandem saves the critic's model, optimizer and scheduler with the actor's",
    "critic.profiler.": "use trainer.profile_steps (tandem's PyTorch profiler)",
    **{
        f"{role}.{backend}.": f"a {name} engine setting (parallel sizes, offloading, recomputation, fused "
        "kernels): tandem trains with its own engine, DDP or FSDP2 (docs/engine.md)"
        for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
        for backend, name in (("megatron", "Megatron-LM"), ("mindspeed", "MindSpeed"), ("veomni", "VeOmni"))
    },
    "actor_rollout_ref.actor.engine.": "verl's engine settings (parallel sizes, offloading, recomputation): "
    "tandem trains with its own engine, DDP or FSDP2 (docs/engine.md)",
    "actor_rollout_ref.actor.optim.override_optimizer_config.": "Megatron optimizer settings (CPU offload, "
    "precision-aware optimizer): tandem uses torch's AdamW (actor.offload.optimizer offloads its state)",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.": "tandem's FSDP2 computes in bf16 and reduces "
    "gradients in fp32 (actor.fsdp_config.dtype decides); verl's mixed-precision dtypes are not read",
    "actor_rollout_ref.model.mtp.": "read only with actor_rollout_ref.model.mtp.enable, which tandem refuses",
    "actor_rollout_ref.actor.fsdp_config.qat.": "read only with actor_rollout_ref.actor.fsdp_config.qat.enable, "
    "which tandem refuses",
    "distillation.": "read only with distillation.enabled, which tandem refuses",
    "actor_rollout_ref.rollout.prometheus.": "metrics export of verl's rollout servers; tandem logs rollout metrics itself",
    "reward_model.rollout.": "the reward model's serving engine: tandem runs reward.model in its own worker",
    "reward.reward_model.rollout.": "the reward model's serving engine: tandem runs reward.model in its own worker",
}


@dataclass(frozen=True)
class Translation:
    """The tandem overrides a verl command becomes, and the notes for keys that change nothing here."""

    overrides: tuple[str, ...]
    notes: tuple[str, ...]

    def command_overrides(self) -> list[str]:
        """The ``tandem train`` arguments that give the same config (the preset first)."""
        return [f"preset={BASE_PRESET}", *self.overrides]

    def config(self, extra: Sequence[str] = (), plugins: Sequence[str] = ()) -> TrainConfig:
        """The typed config, with ``extra`` tandem overrides applied last (and ``--plugin``'s
        ``plugins``); a tandem validation error also names the verl key behind each tandem key it
        mentions."""
        try:
            return load_train_config([*self.command_overrides(), *extra], plugins=plugins)
        except ValueError as error:
            raise ValueError(_with_verl_names(str(error))) from None


def translate(items: Sequence[str]) -> Translation:
    """Translate verl ``key=value`` items (see the module docstring)."""
    given = _parse(items)
    notes = [note for key in given if (note := _check(key, given[key]))]
    values = {**DEFAULTS, **given}
    ctx = Context(values, set(given))
    for rule in RULES:
        if rule.kind == "mapped" and rule.key in values and _matters(rule, values, given):
            ctx.out[rule.to] = _convert(rule, values[rule.key])
    for translate_group in joint.TRANSLATORS:
        translate_group(ctx)
    workers, on_gpu = joint_training.placement(ctx)
    joint_training.micro_batches(ctx, workers)
    joint_training.critic(ctx, workers)
    joint_training.dtypes(ctx, on_gpu)
    overrides = tuple(f"{key}={render(value)}" for key, value in sorted(ctx.out.items()))
    return Translation(overrides, tuple(notes + ctx.notes))


def _parse(items: Sequence[str]) -> dict[str, Any]:
    parser = OverridesParser.create()
    given: dict[str, Any] = {}
    for item in items:
        if item.startswith("~"):
            raise ValueError(f"{item}: removing verl keys (~key) is not translated; leave the key out")
        if "=" not in item:
            raise ValueError(f"{item!r} is not a verl override: expected key=value")
        try:
            (override,) = parser.parse_overrides([item])
        except HydraException as error:
            raise ValueError(f"{item!r}: {error}") from None
        key = override.key_or_group
        if override.is_sweep_override():
            raise ValueError(f"{item}: a sweep (several values) is not a run; give {key} one value")
        given.pop(key, None)  # as in Hydra (and so verl), the last value of a key wins
        given[key] = override.value()
    return given


def _check(key: str, value: Any) -> str:
    """The note for ``key`` (empty if none); raises for keys tandem cannot honour."""
    rule = BY_KEY.get(key)
    if rule is None:
        for prefix, note in NOTED_PREFIXES.items():
            if key.startswith(prefix):
                return f"{key}: {note}"
        close = difflib.get_close_matches(key, list(BY_KEY), n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(
            f"{key} is not a verl key tandem translates{hint} (docs/migrating-from-verl.md lists them; "
            "drop it, or run tandem train with tandem's own keys)"
        )
    if rule.kind == "required value" and value not in rule.only:
        allowed = " or ".join(repr(v) for v in rule.only)
        raise ValueError(f"{key}={value!r}: tandem does not implement {rule.why} (it accepts {allowed} only)")
    if rule.kind == "noted":
        return f"{key}: {rule.note}"
    return ""


def _matters(rule: Rule, values: dict[str, Any], given: dict[str, Any]) -> bool:
    """A value the command set always carries over; a default only when its ``when`` holds."""
    if rule.key in given or rule.when is None:
        return True
    key, wanted = rule.when
    return values.get(key) in wanted


def _convert(rule: Rule, value: Any) -> Any:
    try:
        return rule.convert(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{rule.key}={value!r}: {error}") from None


SAFE_STRING = re.compile(r"^[A-Za-z_/.][\w./:+-]*$")
HYDRA_WORDS = {"true", "false", "null", "nan", "inf"}  # parsed as values, not strings


def render(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(render(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{render(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if SAFE_STRING.match(text) and text.lower() not in HYDRA_WORDS:
        return text
    # Hydra unescapes backslashes only before a quote (or the closing quote): double just those
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'") + "'"


def _reverse_names() -> dict[str, list[str]]:
    tandem_to_verl: dict[str, list[str]] = {}
    for rule in RULES:
        target = rule.to.split(" ")[0]
        if rule.kind in ("mapped", "joint") and "." in target:
            tandem_to_verl.setdefault(target, []).append(rule.key)
    return tandem_to_verl


def _with_verl_names(message: str) -> str:
    """``message`` with the verl key(s) behind each tandem key it mentions."""
    found = [
        f"{tandem} is verl's {' / '.join(verl)}"
        for tandem, verl in _reverse_names().items()
        if verl != [tandem] and re.search(rf"(?<![\w.]){re.escape(tandem)}(?![\w])", message)
    ]
    return f"{message} [{'; '.join(found)}]" if found else message
