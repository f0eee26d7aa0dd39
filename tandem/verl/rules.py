"""The rule of one verl key (:class:`Rule`), the builders the key table writes its rules with, and
the notes several rules share. :mod:`tandem.verl.keys` holds the table itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.verl import names

MISSING = object()


@dataclass(frozen=True)
class Rule:
    """One verl key.

    Attributes:
        key: verl's dotted key.
        default: verl's default (``MISSING``: none, the key is required or optional).
        to: the tandem key it sets (mapped keys), or a description of where it goes (joint).
        convert: verl value -> tandem value (mapped keys).
        joint: read together with related keys by :mod:`tandem.verl.joint`.
        note: why a noted key changes nothing here.
        only: the values a required-value key accepts (tandem lacks the feature they leave off).
        why: what tandem lacks, for the error of a required-value key.
        example: a value for the key's translation test (defaults to ``default``).
        when: ``(verl key, values)``: verl's default of a mapped key is only carried over when
            that key has one of those values (a loss's own knobs, say, only with that loss), so
            the tandem command stays short; a value the command sets is always carried over.
    """

    key: str
    default: Any = MISSING
    to: str = ""
    convert: Callable[[Any], Any] | None = None
    joint: bool = False
    note: str = ""
    only: tuple = ()
    why: str = ""
    example: Any = MISSING
    when: tuple[str, tuple] | None = None

    @property
    def kind(self) -> str:
        if self.note:
            return "noted"
        if self.only:
            return "required value"
        return "joint" if self.joint else "mapped"


def same(value: Any) -> Any:
    return value


def off_if_negative(value: Any) -> int:
    """verl's ``-1``/``null`` (off, unlimited) -> tandem's 0."""
    return 0 if value is None or int(value) < 0 else int(value)


def named(key: str) -> Callable[[Any], str]:
    return lambda value: names.tandem_name(key, value)


def comma_list(value: Any) -> str:
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


def mapped(
    key: str,
    to: str,
    default: Any = MISSING,
    convert: Callable[[Any], Any] = same,
    example: Any = MISSING,
    when: tuple[str, tuple] | None = None,
) -> Rule:
    return Rule(key, default, to, convert, example=example, when=when)


def joint(key: str, to: str, default: Any = MISSING, example: Any = MISSING) -> Rule:
    return Rule(key, default, to, joint=True, example=example)


def noted(key: str, note: str, example: Any = MISSING) -> Rule:
    return Rule(key, note=note, example=example)


def only(key: str, values: tuple, why: str) -> Rule:
    return Rule(key, only=values, why=why, example=values[0])


ARF = "actor_rollout_ref"
ACTOR = f"{ARF}.actor"
ROLLOUT = f"{ARF}.rollout"
REF = f"{ARF}.ref"
MODEL = f"{ARF}.model"
ALGO = "algorithm"


def with_loss(*modes: str) -> tuple[str, tuple]:
    return (f"{ACTOR}.policy_loss.loss_mode", modes)


WITH_KL_PENALTY = (f"{ALGO}.use_kl_in_reward", (True,))
WITH_LORA = (f"{MODEL}.lora_rank", tuple(range(1, 4097)))

MEMORY = "a memory or speed setting; tandem decides it itself and the results do not depend on it"
OFFLOAD = "offloading within a phase: tandem keeps what a phase computes with on the worker's device"
LOGPROB_MICRO = "forward-only passes use the actor's micro-batch budget in tandem"
LOGPROB_MICRO_KEYS = (  # the reference's and the rollout's log-prob batching
    "log_prob_micro_batch_size",
    "log_prob_micro_batch_size_per_gpu",
    "log_prob_use_dynamic_bsz",
    "log_prob_max_token_len_per_gpu",
)
REFERENCE_SP = (
    "the actor's actor.engine.sp_size (the reference runs in the actor's workers); another size is refused"
)
RAY = "tandem starts Ray itself (trainer.backend=ray)"
# A name verl does not have is refused by tandem.verl.joint.engine_settings, as are parallel sizes
# that are not positive integers.
STRATEGY = "tandem picks DDP or FSDP2 by the number of workers"
NOT_YET_PARALLEL = "(each rollout replica holds the whole model)"
ONE_GPU_REPLICA = (
    "tandem's sync pipeline runs each vLLM engine in a trainer worker, on its one GPU (memory only); "
    "rollout.engine.vllm.tensor_parallel_size splits a replica over several GPUs in one_step_off and fully_async"
)
TOKEN_IN_TOKEN_OUT = (
    "tandem's episodes are token in, token out: the model's tokens as sampled, the chat template's "
    "tokens for the other turns (docs/agents.md)"
)
BACKEND = (
    "verl's training backend (dp, veomni, ...); tandem trains with its own engine (docs/engine.md); "
    "megatron and mindspeed are refused"
)
UNREAD_TAU = (
    "verl's SAPO reads actor_rollout_ref.actor.tau_pos/tau_neg; this key (added with + in verl's SAPO "
    "example) is read by neither verl nor tandem"
)
RM_PLACEMENT = "where verl places the reward model; tandem runs reward.model in its own worker"
ENGINE_ROUTER_REPLAY = "router replay in verl's Megatron and VeOmni engines; tandem's is actor_rollout_ref.actor.router_replay.mode=R3"
MOE_LOSS = "a Megatron MoE auxiliary loss (tandem's own: actor.engine.moe_aux_loss_coef)"
FP8 = "fp8 training"
DIST_CKPT = "starting from Megatron distributed checkpoints (start from the HF model directory)"
LEGACY_IMPL = "an implementation switch of verl 0.7 (its legacy or new worker classes); tandem has one"
