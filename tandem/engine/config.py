"""``EngineConfig``: everything the torch training engine needs to know, validated up front."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from tandem.config.paths import MODEL_PATH, path_field
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.device import check_bf16_compute, check_device_setting
from tandem.engine.parallel_dims import ParallelDims
from tandem.models.loading import DTYPES
from tandem.models.logprobs import HEAD_DTYPES

STRATEGIES = ("single", "ddp", "fsdp2")
HEADS = ("lm", "value", "reward")
MIXED_PRECISION = ("none", "bf16")
LR_SCHEDULES = ("constant", "linear", "cosine")
ROUTER_REPLAY = ("off", "rollout")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA through PEFT; ``rank=0`` turns it off.

    Attributes:
        rank / alpha / dropout: the adapter's rank, scaling numerator and dropout.
        target_modules: comma-separated module names to adapt, or ``all-linear`` (every linear layer but the head).
    """

    key_prefix: ClassVar[str] = "engine.lora"  # its messages' keys start so (tandem.config.build)

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str = "all-linear"

    def __post_init__(self) -> None:
        check_range(self.key_prefix, "rank", self.rank, low=0)
        check_positive(self.key_prefix, "alpha", self.alpha)
        check_range(self.key_prefix, "dropout", self.dropout, 0.0, 1.0, high_inclusive=False)


@dataclass(frozen=True)
class EngineConfig:
    """The torch training engine (``actor.engine.*``, ``critic.engine.*``, ``teacher.engine.*``; ``engine.*`` of
    ``tandem sft``, ``dpo`` and ``rm``).

    Attributes:
        model_path: a local HF model directory (``save_pretrained`` layout).
        head: ``lm`` (a policy: per-token log-probs through the LM head) or ``value`` (a
            critic: the decoder with a one-output ``score`` head, per-token values; a causal LM
            directory loads with a fresh head) or ``reward`` (a reward model: the same head read
            at each token, an HF ``...ForSequenceClassification`` model; see
            :mod:`tandem.engine.reward_model`).
        device: ``auto`` (CUDA when a GPU is visible), ``cpu``, ``cuda`` (the GPU of this
            process's local rank) or ``cuda:N``; see :mod:`tandem.device`.
        strategy: ``single`` process, ``ddp`` or ``fsdp2`` data parallel over the default process group.
        param_dtype: dtype of the parameters (``float32`` or ``bfloat16``); optimizer math stays in it.
        mixed_precision: ``none``, or ``bf16``: the decoder computes in bf16 while parameters,
            gradients' reduction and the optimizer stay in ``param_dtype`` (FSDP2's mixed
            precision policy under ``fsdp2``, autocast otherwise). The output head is fp32 either way.
            On the CPU it needs bf16 matrix instructions (AVX-512 BF16 or AMX): without them
            it is an error (:func:`tandem.device.check_bf16_compute`), here for ``device=cpu``
            and when the engine binds its device for ``auto``.
        use_packing: pack valid tokens into one row ("remove padding") instead of padded rows.
        max_tokens_per_micro_batch: token budget of a micro-batch (packing) — see ``micro_batch_size``.
        micro_batch_size: sequences per micro-batch when not packing (fixed-size, padded).
        share_prompts: with packing, rows of a batch with a ``prompts`` column that carry the
            same prompt compute it once (see :mod:`tandem.engine.shared_prompts`); a prompt
            group stays in one micro-batch unless it alone exceeds the token budget. Only
            response tokens then get log-probs.
        pad_tokens_to_multiple: with packing, filler tokens round each packed row up to a
            multiple of this (1: off). Linear-layer shapes then repeat across steps, so
            oneDNN reuses its per-shape kernels instead of building (and caching) new ones
            each step; fillers change no result.
        gradient_checkpointing: recompute activations in backward.
        freeze_vision_tower: a vision-language model's vision tower (patch embedding, blocks and
            merger) does not train: no gradients, not in the optimizer. Under LoRA it is
            frozen either way (adapters go on
            the language model only). No effect on a text model. See
            :mod:`tandem.engine.vision_model`.
        logprob_chunk_size: rows of the fp32 output head computed at once, at most (fewer
            where one chunk's fp32 logits would pass 64 MiB: ``tandem.models.logprobs.chunk_rows``).
        logprob_head_dtype: the precision of the log-prob head's product: ``float32`` (hidden
            states and weight in fp32) or ``bfloat16`` (both rounded to bf16, products summed
            in fp32, logits and softmax in fp32; the logits' gradient rounded to bf16 in
            backward). ``bfloat16`` puts the head on a GPU's tensor cores; see
            :mod:`tandem.models.logprobs`.
        logprob_temperature: the sampling temperature the rollout used; log-probs are computed
            under ``softmax(logits / T)`` so they match the rollout's processed log-probs.
        lr / weight_decay / betas / eps: AdamW.
        grad_clip: max global grad norm (None: no clipping, the norm is still returned).
        lr_schedule / warmup_steps / total_steps / min_lr_ratio: learning-rate schedule
            (``total_steps`` 0: the trainer fills in its optimizer-step count).
        warmup_from_zero: warmup step ``s`` uses ``lr * s / warmup_steps`` (verl's schedule: the
            first step at lr 0) instead of ``lr * (s + 1) / warmup_steps``.
        warmup_ratio: with ``warmup_steps`` 0, warm up for ``int(warmup_ratio * total_steps)``
            steps (verl's ``lr_warmup_steps_ratio``).
        sp_size: Ulysses sequence parallelism: each packed micro-batch is split along the
            sequence over this many ranks, which trade sequence shards for head shards around
            attention (see docs/parallelism.md). The world size must divide by it, and the
            model's attention heads too; needs ``use_packing``. 1: off.
        tp_size: tensor parallelism: each decoder layer's attention and MLP weights, the token
            embedding and the output head are split over this many ranks (Megatron-LM's split
            with DTensor; the log-softmax is vocabulary-parallel), which hold the same rows.
            The world size must divide by it, and the model's query and key/value heads too.
            With ``strategy=fsdp2`` FSDP2 shards each rank's tensor-parallel shards over
            ``dp x sp``; ``single`` trains one tensor-parallel group
            (the world is ``tp_size`` ranks; more ranks run forward passes only). Combines with
            ``sp_size`` (the mesh is ``(dp, sp, tp)``; the heads must divide by
            ``sp_size x tp_size``) and LoRA (each adapter split as its base layer is); refused
            with ``ddp``. See docs/parallelism.md. 1: off.
        moe_aux_loss_coef: a mixture-of-experts model's load-balancing loss (HF's
            ``load_balancing_loss_func`` of the live router logits) is added to every training
            micro-batch's loss with this weight (0: off; a dense model refuses anything else);
            reported as ``moe/aux_loss``. See docs/moe.md.
        router_replay: ``off``, or ``rollout``: the forward passes of an MoE model run the
            experts the rollout chose for each token (the batch's ``routed_experts``), with
            weights from the live router renormalised over them (rollout routing replay, R3;
            :mod:`tandem.models.moe`).
        ep_size: expert parallelism: every MoE layer's experts are split over this many
            data-parallel ranks (rank ``r`` of a group holds experts ``r * E / ep_size ..``),
            and each layer sends its routed tokens to their experts' ranks and back with
            all-to-alls (:mod:`tandem.engine.expert_parallel`). The world size and the model's
            ``num_experts`` must divide by it (under ``tp_size > 1``, the ``world / tp_size``
            data-parallel ranks). Trains with ``ddp`` or ``fsdp2`` (``single``: forward passes
            only); combines with ``sp_size``, ``tp_size`` and LoRA (which leaves the experts
            frozen). See docs/moe.md. 1: off.
        lora: LoRA adapter settings.
        seed: parameter-init / dropout seed.
    """

    key_prefix: ClassVar[str] = "engine"  # its messages' keys start so (tandem.config.build)

    model_path: str = path_field(MODEL_PATH)
    head: str = "lm"
    device: str = "auto"
    strategy: str = "single"
    param_dtype: str = "float32"
    mixed_precision: str = "none"
    use_packing: bool = True
    max_tokens_per_micro_batch: int = 4096
    micro_batch_size: int = 8
    share_prompts: bool = True
    pad_tokens_to_multiple: int = 64
    gradient_checkpointing: bool = False
    freeze_vision_tower: bool = False
    logprob_chunk_size: int = 1024
    logprob_head_dtype: str = "float32"
    logprob_temperature: float = 1.0
    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    warmup_from_zero: bool = False
    warmup_ratio: float = 0.0
    sp_size: int = 1
    tp_size: int = 1
    moe_aux_loss_coef: float = 0.0
    router_replay: str = "off"
    ep_size: int = 1
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        owner = self.key_prefix
        check_device_setting(owner, "device", self.device)
        check_choice(owner, "strategy", self.strategy, STRATEGIES)
        check_choice(owner, "head", self.head, HEADS)
        check_choice(owner, "mixed_precision", self.mixed_precision, MIXED_PRECISION)
        if self.mixed_precision == "bf16" and self.device == "cpu":  # auto: when the engine binds it
            check_bf16_compute(f"{owner}.mixed_precision", self.device)
        check_choice(owner, "param_dtype", self.param_dtype, [d for d in DTYPES if d != "float16"])
        check_choice(owner, "lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_choice(owner, "logprob_head_dtype", self.logprob_head_dtype, list(HEAD_DTYPES))
        check_choice(owner, "router_replay", self.router_replay, ROUTER_REPLAY)
        check_range(owner, "moe_aux_loss_coef", self.moe_aux_loss_coef, low=0.0)
        for name in (
            "max_tokens_per_micro_batch",
            "micro_batch_size",
            "pad_tokens_to_multiple",
            "logprob_chunk_size",
            "logprob_temperature",
            "lr",
            "eps",
            "sp_size",
            "tp_size",
            "ep_size",
        ):
            check_positive(owner, name, getattr(self, name))
        if self.tp_size > 1:
            _check_tensor_parallel(self, owner)
        if self.sp_size > 1 and not self.use_packing:
            raise ValueError(
                f"{owner}.sp_size={self.sp_size} needs {owner}.use_packing=True: sequence parallelism "
                "splits packed rows"
            )
        check_range(owner, "weight_decay", self.weight_decay, low=0.0)
        check_range(owner, "warmup_steps", self.warmup_steps, low=0)
        check_range(owner, "min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range(owner, "warmup_ratio", self.warmup_ratio, 0.0, 1.0, high_inclusive=False)
        if self.grad_clip is not None:
            check_positive(owner, "grad_clip", self.grad_clip)
        if self.lr_schedule != "constant" and 0 < self.total_steps <= self.warmup:
            raise ValueError(
                f"{owner}.total_steps={self.total_steps} must exceed warmup_steps={self.warmup} "
                f"for lr_schedule={self.lr_schedule!r}"
            )

    @property
    def warmup(self) -> int:
        """Warmup steps: ``warmup_steps``, or ``warmup_ratio`` of ``total_steps`` when that is 0."""
        return self.warmup_steps or int(self.warmup_ratio * self.total_steps)


def _check_tensor_parallel(config: EngineConfig, owner: str) -> None:
    """Refuse what tensor parallelism (``tp_size > 1``) does not combine with, naming both keys."""
    refused = {
        "strategy": (
            config.strategy == "ddp",
            "the split weights are DTensors, which DDP does not reduce; use fsdp2 (or single)",
        ),
    }
    _refuse(config, owner, "tp_size", refused)


def _refuse(config: EngineConfig, owner: str, size_key: str, refused: dict[str, tuple[bool, str]]) -> None:
    """Raise naming ``<owner>.<size_key>`` and the first key of ``refused`` that applies, with why."""
    for key, (applies, why) in refused.items():
        if applies:
            raise ValueError(
                f"{owner}.{size_key}={getattr(config, size_key)} with {owner}.{key}={_setting(config, key)}: {why}"
            )


def _setting(config: object, dotted: str) -> object:
    """``config.a.b`` for ``"a.b"``."""
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def check_trainer_parallel_dims(owner: str, engine: EngineConfig, workers: int) -> None:
    """Raise ``ValueError`` naming ``<owner>.sp_size``, ``tp_size`` or ``ep_size`` when a trainer's
    ``workers`` cannot hold ``engine``'s mesh (:meth:`~tandem.engine.parallel_dims.ParallelDims.check`):
    they must split into groups of ``sp_size x tp_size`` (each group one data-parallel rank, its
    workers handed the same rows), and ``ep_size`` must divide the ``dp x sp`` workers of one
    tensor-parallel slice (the ranks holding different tokens). ``strategy=single`` trains one
    tensor-parallel group only (several need ``fsdp2`` to reduce their gradients over ``dp x sp``)."""
    tp = engine.tp_size
    dims = ParallelDims(workers, engine.sp_size, tp, engine.ep_size)
    dims.check(owner, world=f"the {workers} workers", unit="workers")
    if tp > 1 and engine.strategy == "single" and workers > tp:
        raise ValueError(
            f"{owner}.tp_size={tp} with {owner}.strategy=single trains one tensor-parallel group, but the "
            f"{workers} workers form {workers // tp}: set {owner}.strategy=fsdp2 (it reduces their gradients)"
        )
