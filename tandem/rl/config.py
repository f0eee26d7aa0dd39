"""``TrainConfig``: everything ``tandem train`` reads, as typed dataclasses validated up front.

Batch-size semantics (the same as verl's):

* ``data.train_batch_size`` — prompts sampled per step; each gets ``rollout.n`` responses,
  so a step trains on ``train_batch_size * n`` sequences.
* ``actor.ppo_mini_batch_size`` — prompts per optimizer step (``* n`` sequences); a step
  makes ``train_batch_size / ppo_mini_batch_size`` optimizer steps per epoch, for
  ``actor.ppo_epochs`` epochs.
* micro-batches — how a mini-batch is cut for gradient accumulation: a token budget
  (``actor.engine.max_tokens_per_micro_batch``, with packing) or a sequence count
  (``actor.engine.micro_batch_size``). They change memory, never the result.
* workers — ``trainer.nnodes`` nodes of ``trainer.n_gpus_per_node`` GPU workers each (one
  per GPU), or of ``trainer.n_workers`` CPU workers each; every worker gets an equal share of
  every mini-batch, so ``ppo_mini_batch_size * n`` must divide by their number.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tandem.agents.config import AgentConfig
from tandem.algos import (
    ADVANTAGE_ESTIMATORS,
    AdvantageConfig,
    KLConfig,
    PolicyLossConfig,
    estimator_inputs,
    estimator_requirements,
)
from tandem.algos.preference import PreferenceLossConfig
from tandem.algos.rollout_correction import RolloutCorrectionConfig
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.controller.resource_pool import ResourcePool
from tandem.device import check_device_setting
from tandem.engine.config import EngineConfig
from tandem.engine.offload import OffloadConfig
from tandem.pipeline.config import PipelineConfig
from tandem.rl.critic_config import CriticConfig
from tandem.rl.judge_config import JudgeConfig
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.types import SamplingParams

BACKENDS = ("local", "ray")
RESUME_MODES = ("auto", "disable")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


OVERLONG_PROMPTS = ("filter", "error", "truncate_left", "truncate_right", "truncate_middle")


@dataclass(frozen=True)
class RLDataConfig:
    """Prompts (``data.*``): parquet or JSONL files in verl's schema (see :mod:`tandem.rl.data`).

    Attributes:
        train_path / val_path: parquet or JSONL files (``val_path`` empty: no validation).
        train_batch_size: prompts per step.
        max_prompt_length: longest tokenised prompt (chat template applied).
        overlong_prompts: ``filter`` (drop them, counted and reported), ``error``, or cut them
            to ``max_prompt_length`` tokens: ``truncate_left`` (keep the end), ``truncate_right``
            (keep the start), ``truncate_middle`` (keep both ends).
        shuffle: a fresh seeded order each epoch.
        val_max_samples: evaluate on at most this many validation prompts (0: all).
    """

    train_path: str = ""
    val_path: str = ""
    train_batch_size: int = 32
    max_prompt_length: int = 256
    overlong_prompts: str = "filter"
    shuffle: bool = True
    val_max_samples: int = 0

    def __post_init__(self) -> None:
        check_positive("data", "train_batch_size", self.train_batch_size)
        check_positive("data", "max_prompt_length", self.max_prompt_length)
        check_choice("data", "overlong_prompts", self.overlong_prompts, OVERLONG_PROMPTS)
        check_range("data", "val_max_samples", self.val_max_samples, low=0)


OBJECTIVES = ("policy_gradient", "preference")


@dataclass(frozen=True)
class ActorOffloadConfig(OffloadConfig):
    """What the colocated loop keeps on the CPU while it is not needed (``actor.offload.*``),
    so that generation, and the rollout engine's KV cache, get the GPU's memory.

    Attributes:
        params: the actor's parameters leave the GPU while it generates and come
            back before the next log-prob pass or update (verl's ``param_offload``).
        optimizer: the actor's optimizer state stays on the CPU except during the update
            (verl's ``optimizer_offload``).
        reference: the reference model stays on the CPU except while it computes log-probs
            (verl's ``ref.fsdp_config.param_offload``; with LoRA there is no separate reference).

    On the CPU there is nothing to offload and these change nothing. The results never depend
    on them: only where the state waits between phases changes.
    """

    reference: bool = False


@dataclass(frozen=True)
class ActorConfig:
    """The policy and its update (``actor.*``).

    Attributes:
        engine: the training engine. Its ``model_path``, ``device``, ``seed`` and
            ``logprob_temperature`` follow ``model_path``, ``trainer.device``, ``trainer.seed``
            and ``rollout.temperature`` (setting them here to something else is an error), its
            strategy follows ``trainer.n_workers``, and ``total_steps`` 0 means the run's
            optimizer-step count (see :mod:`tandem.rl.derived`).
        policy_loss: the policy loss (``actor.policy_loss.name``: a registered loss, ``tandem
            algos`` lists them) and its settings: ``loss_agg_mode``, ``clip_ratio_low`` /
            ``clip_ratio_high`` / ``clip_ratio_c``, and each loss's own knobs
            (:class:`~tandem.algos.PolicyLossConfig`).
        ppo_mini_batch_size: prompts per optimizer step (0: the whole step's batch, one update).
        ppo_epochs: passes over the step's batch.
        shuffle_mini_batches: reshuffle sequences between epochs.
        entropy_coeff: weight of an entropy bonus (0: off).
        recompute_old_log_probs: always run a separate forward for the old log-probs. By default
            a purely on-policy step (one epoch, one mini-batch, no KL penalty in the reward, no
            rollout correction, an advantage estimator that does not read them) takes them from
            the update's own forward (detached): the same values, one forward fewer. The
            rollout-vs-trainer mismatch is logged either way.
        objective: ``policy_gradient`` (advantages and ``policy_loss``) or ``preference``
            (online DPO: each prompt's best- and worst-scored responses form a pair, trained
            with ``preference``, one optimizer step per step; see docs/dpo.md).
        preference: the preference loss when ``objective=preference``
            (:class:`~tandem.algos.preference.PreferenceLossConfig`: ``name``, ``beta``, ...).
        offload: what the colocated loop keeps on the CPU between the phases that need it
            (:class:`ActorOffloadConfig`: ``params``, ``optimizer``, ``reference``).
    """

    engine: EngineConfig = field(default_factory=lambda: EngineConfig(lr=1e-6))
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    ppo_mini_batch_size: int = 0
    ppo_epochs: int = 1
    shuffle_mini_batches: bool = False
    entropy_coeff: float = 0.0
    recompute_old_log_probs: bool = False
    objective: str = "policy_gradient"
    preference: PreferenceLossConfig = field(default_factory=PreferenceLossConfig)
    offload: ActorOffloadConfig = field(default_factory=ActorOffloadConfig)

    def __post_init__(self) -> None:
        check_choice("actor", "objective", self.objective, OBJECTIVES)
        check_range("actor", "ppo_mini_batch_size", self.ppo_mini_batch_size, low=0)
        check_positive("actor", "ppo_epochs", self.ppo_epochs)
        check_range("actor", "entropy_coeff", self.entropy_coeff, low=0.0)


@dataclass(frozen=True)
class RolloutConfig:
    """Generation (``rollout.*``): what to sample, and which engine samples it.

    Attributes:
        n: responses per prompt.
        temperature / top_p / top_k: sampling (the trainer's log-probs use the same temperature).
        max_response_length: most new tokens per response.
        engine: the rollout engine (``rollout.engine.name=native|vllm|hf``) and each engine's
            own settings (``rollout.engine.native.max_num_seqs``, ...). Its longest sequence,
            seed and device follow the data, ``trainer.seed`` and ``trainer.device``.
        val_temperature / val_n: validation sampling (temperature 0: greedy, so ``val_n`` is 1).
        val_top_p / val_top_k: validation's truncation (None: the same as training's).
        free_cache_between_generations: free the KV cache after each generation and allocate it
            again before the next, so the actor's update has that memory (colocated training on
            a memory-bound accelerator); off by default, since re-allocation costs time on CPU.
    """

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_response_length: int = 256
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    val_temperature: float = 0.0
    val_n: int = 1
    val_top_p: float | None = None
    val_top_k: int | None = None
    free_cache_between_generations: bool = False

    def __post_init__(self) -> None:
        check_positive("rollout", "n", self.n)
        check_positive("rollout", "temperature", self.temperature)
        check_range("rollout", "top_p", self.top_p, 0.0, 1.0, low_inclusive=False)
        check_range("rollout", "top_k", self.top_k, low=0)
        check_positive("rollout", "max_response_length", self.max_response_length)
        check_range("rollout", "val_temperature", self.val_temperature, low=0.0)
        check_positive("rollout", "val_n", self.val_n)
        if self.val_top_p is not None:
            check_range("rollout", "val_top_p", self.val_top_p, 0.0, 1.0, low_inclusive=False)
        if self.val_top_k is not None:
            check_range("rollout", "val_top_k", self.val_top_k, low=0)
        if self.val_temperature == 0.0 and self.val_n != 1:
            raise ValueError(
                f"rollout.val_n={self.val_n} needs rollout.val_temperature > 0 (greedy is deterministic)"
            )
        vllm_cannot_sleep = self.engine.name == "vllm" and not self.engine.vllm.enable_sleep_mode
        if self.free_cache_between_generations and vllm_cannot_sleep:
            raise ValueError(
                "rollout.free_cache_between_generations=true with rollout.engine.name=vllm needs "
                "rollout.engine.vllm.enable_sleep_mode=true (vLLM frees its cache only by sleeping)"
            )

    def sampling(self, temperature: float, validation: bool = False) -> SamplingParams:
        """How one response is sampled at ``temperature`` (0: greedy, so top-p/top-k are off);
        ``validation`` applies ``val_top_p`` / ``val_top_k`` where set."""
        greedy = temperature == 0.0
        top_p = self.val_top_p if validation and self.val_top_p is not None else self.top_p
        top_k = self.val_top_k if validation and self.val_top_k is not None else self.top_k
        return SamplingParams(
            temperature=temperature,
            top_p=1.0 if greedy else top_p,
            top_k=0 if greedy else top_k,
            max_tokens=self.max_response_length,
        )


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (``algorithm.filter_groups.*``): drop prompt groups whose n
    rewards are all equal (no learning signal) and generate more until the step is full.

    Attributes:
        enable: on/off.
        max_num_gen_batches: most generation rounds per step (then train on what there is).
        metric: what must differ within a group: ``score`` (the reward trained on, overlong
            penalty included), ``raw_score`` (the scorer's score before that penalty) or ``acc``
            (the scorer's accuracy; DAPO's choice in verl).
    """

    enable: bool = False
    max_num_gen_batches: int = 4
    metric: str = "score"

    def __post_init__(self) -> None:
        check_positive("algorithm.filter_groups", "max_num_gen_batches", self.max_num_gen_batches)
        check_choice("algorithm.filter_groups", "metric", self.metric, ["score", "raw_score", "acc"])


@dataclass(frozen=True)
class AlgorithmConfig:
    """Advantages, KL and rollout correction (``algorithm.*``).

    Attributes:
        adv_estimator: a registered advantage estimator (``tandem algos`` lists them).
        norm_adv_by_std: divide GRPO advantages by the group's std (False: Dr. GRPO).
        gamma / lam: discount and GAE lambda for the estimators that use them.
        gdpo_reward_keys: GDPO's reward components, by name: fields of the dict the reward
            function returns (each result must carry them all); empty: GDPO normalises the score.
        gdpo_reward_weights: GDPO's weight per key (empty: all 1).
        kl: reference-KL use (``kl.use_kl_loss`` for the actor loss, ``kl.use_kl_in_reward`` for a penalty).
        rollout_correction: TIS / MIS against the rollout-vs-trainer mismatch.
        filter_groups: DAPO dynamic sampling.
    """

    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True
    gamma: float = 1.0
    lam: float = 1.0
    gdpo_reward_keys: tuple[str, ...] = ()
    gdpo_reward_weights: tuple[float, ...] = ()
    kl: KLConfig = field(default_factory=KLConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)

    def __post_init__(self) -> None:
        check_choice("algorithm", "adv_estimator", self.adv_estimator, ADVANTAGE_ESTIMATORS.names())
        self.advantage_config()  # validates the estimator's own settings, named algorithm.*

    def advantage_config(self) -> AdvantageConfig:
        return AdvantageConfig(
            estimator=self.adv_estimator,
            gamma=self.gamma,
            lam=self.lam,
            norm_adv_by_std=self.norm_adv_by_std,
            gdpo_reward_keys=tuple(self.gdpo_reward_keys),
            gdpo_reward_weights=tuple(self.gdpo_reward_weights),
        )

    @property
    def needs_reference(self) -> bool:
        return self.kl.use_kl_loss or self.kl.use_kl_in_reward

    @property
    def needs_values(self) -> bool:
        """The estimator reads a critic's values (``gae``): a critic is trained beside the actor."""
        return "values" in estimator_requirements(self.adv_estimator)

    @property
    def compares_groups(self) -> bool:
        """The estimator compares the n responses of each prompt (it reads group ids)."""
        return "group_ids" in estimator_requirements(self.adv_estimator)

    @property
    def needs_greedy_baseline(self) -> bool:
        """The estimator reads a per-sample baseline reward: the greedy response's (ReMax)."""
        return "reward_baselines" in estimator_requirements(self.adv_estimator)

    @property
    def reward_component_keys(self) -> tuple[str, ...]:
        """The reward components scoring must return for the estimator (``reward_components``), in order."""
        return (
            tuple(self.gdpo_reward_keys)
            if "reward_components" in estimator_inputs(self.adv_estimator)
            else ()
        )

    @property
    def advantages_need_old_log_probs(self) -> bool:
        """The estimator reads the old log-probs, so they exist before the update."""
        return "old_log_probs" in estimator_requirements(self.adv_estimator)

    @property
    def needs_sum_pi_squared(self) -> bool:
        """The estimator reads ``sum_v pi_old(v)^2`` per token (the optimal token baseline)."""
        return "sum_pi_squared" in estimator_requirements(self.adv_estimator)


@dataclass(frozen=True)
class OverlongPenaltyConfig:
    """DAPO's soft overlong punishment (``reward.overlong.*``): responses longer than
    ``max_response_length - buffer`` lose up to ``penalty_factor`` linearly with the excess."""

    enable: bool = False
    buffer: int = 64
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        check_positive("reward.overlong", "buffer", self.buffer)
        check_range("reward.overlong", "penalty_factor", self.penalty_factor, low=0.0)


@dataclass(frozen=True)
class RewardModelSourceConfig:
    """A discriminative reward model as a reward source (``reward.model.*``).

    Attributes:
        path: an HF ``...ForSequenceClassification`` directory with one label (``tandem rm``
            writes one), with its own tokenizer and chat template.
        n_workers: scoring workers, a pool of their own (one in this process with the local
            backend; on GPUs each takes one); each holds the whole model.
        max_length: tokens of prompt and response scored; longer ones keep their end (the
            response) and are counted (``reward/model/truncated``).
        max_tokens_per_micro_batch: the scoring engine's token budget per forward.
        param_dtype: ``float32`` or ``bfloat16``.
    """

    path: str = ""
    n_workers: int = 1
    max_length: int = 2048
    max_tokens_per_micro_batch: int = 16384
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        check_positive("reward.model", "n_workers", self.n_workers)
        check_positive("reward.model", "max_length", self.max_length)
        check_positive("reward.model", "max_tokens_per_micro_batch", self.max_tokens_per_micro_batch)
        check_choice("reward.model", "param_dtype", self.param_dtype, ("float32", "bfloat16"))


REWARD_SOURCES = ("rule", "model", "judge", "interaction")


@dataclass(frozen=True)
class RewardConfig:
    """Scoring (``reward.*``).

    Attributes:
        sources: what scores each response, combined by ``weights``: ``rule`` (the function
            below or the built-in scorer of its ``data_source``), ``model`` (a reward model,
            ``reward.model.*``) and ``judge`` (an LLM behind an OpenAI-compatible endpoint,
            ``reward.judge.*``) and ``interaction`` (the reward the ``interaction`` agent loop's
            user function ends an episode with; 0 where it gave none). Each is logged as
            ``reward/<source>/mean``.
        weights: one per source (empty: 1 each); the score is the weighted sum.
        custom_path: a Python file with a scoring function (empty: the built-in scorers by ``data_source``).
        custom_name: the function's name in that file: ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``.
        num_workers: threads scoring in parallel.
        timeout_s: per-item time limit; a timeout or an exception scores 0 and counts in ``reward/errors``.
        overlong: DAPO's overlong penalty (on the combined score).
        model: the reward-model source.
        judge: the LLM-judge source.
    """

    sources: tuple[str, ...] = ("rule",)
    weights: tuple[float, ...] = ()
    custom_path: str = ""
    custom_name: str = "compute_score"
    num_workers: int = 4
    timeout_s: float = 10.0
    overlong: OverlongPenaltyConfig = field(default_factory=OverlongPenaltyConfig)
    model: RewardModelSourceConfig = field(default_factory=RewardModelSourceConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)

    def __post_init__(self) -> None:
        check_positive("reward", "num_workers", self.num_workers)
        check_positive("reward", "timeout_s", self.timeout_s)
        if not self.sources or len(set(self.sources)) != len(self.sources):
            raise ValueError(f"reward.sources={list(self.sources)} must name each source once")
        for source in self.sources:
            check_choice("reward", "sources", source, REWARD_SOURCES)
        if self.weights and len(self.weights) != len(self.sources):
            raise ValueError(
                f"reward.weights={list(self.weights)} needs one weight per source in reward.sources={list(self.sources)}"
            )
        if "model" in self.sources and not self.model.path:
            raise ValueError("reward.sources has 'model': set reward.model.path (a reward model directory)")
        if "judge" in self.sources and not self.judge.base_url:
            raise ValueError(
                "reward.sources has 'judge': set reward.judge.base_url (an OpenAI-compatible /v1 URL)"
            )

    @property
    def source_weights(self) -> dict[str, float]:
        """Each source's weight, in ``sources`` order."""
        return dict(zip(self.sources, self.weights or (1.0,) * len(self.sources), strict=True))


@dataclass(frozen=True)
class TrainerConfig:
    """The loop (``trainer.*``).

    Attributes:
        total_steps: RL steps (0: ``total_epochs`` passes over the prompts).
        total_epochs: passes over the training prompts when ``total_steps`` is 0.
        device: where every worker computes: ``auto`` (CUDA when the worker sees a GPU), ``cpu``
            or ``cuda`` (each worker its own GPU; see :mod:`tandem.device`).
        backend: ``local`` (in-process for one worker, spawned processes for more) or ``ray``.
        n_workers: data-parallel workers per node on the CPU (each holds actor, rollout and reference).
        nnodes: machines (more than one needs ``backend=ray``).
        n_gpus_per_node: GPUs per node, one worker each (0: CPU workers, ``n_workers`` per node);
            with the Ray backend each worker reserves one GPU and sees only it.
        balance_batch: reorder each step's sequences so every worker gets nearly the same
            number of tokens (:mod:`tandem.rl.balance`); changes no result.
        val_every / save_every: in steps (0: off); ``val_before_train`` evaluates at step 0.
        keep_last: checkpoints kept (older ones are deleted).
        max_skipped_updates_in_a_row: the run stops (naming the step) after this many optimizer
            steps in a row skipped for a non-finite loss or gradient norm; single ones are skipped
            and counted in ``actor/skipped_updates``.
        resume: ``auto`` (latest checkpoint in ``output_dir`` if any), ``disable``, or a checkpoint path.
        output_dir: checkpoints, metrics, the report and the exported model.
        loggers: any of ``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``.
        project / experiment: names for wandb/MLflow.
        seed: data order, sampling seeds and initialisation.
        report: write ``report.html`` (docs/report.md): redrawn during training and at the end,
            beside ``run.json`` (what produced the run) and ``status.json`` (where it is).
            Needs the ``jsonl`` logger, whose ``metrics.jsonl`` it draws.
        report_every: redraw the report every this many steps (and after each validation); 0:
            only at the end.
        export_hf: save the final policy as a plain HF model directory.
        profile_steps: steps to record with the PyTorch profiler: every trainer worker writes a
            Chrome trace per step, ``<profile_dir>/step_<N>/rank<R>.json`` (see docs/rl.md).
        profile_dir: where the traces go (empty: ``<output_dir>/profile``).
        lr_schedule_unit: what one learning-rate schedule step is: an ``optimizer_step`` (the
            warmup and ``total_steps`` count optimizer steps) or an RL ``step`` (one schedule step
            after each step's updates, as verl does; every mini-batch of a step uses the same rate).
    """

    total_steps: int = 0
    total_epochs: int = 1
    device: str = "auto"
    backend: str = "local"
    n_workers: int = 1
    nnodes: int = 1
    n_gpus_per_node: int = 0
    balance_batch: bool = True
    val_every: int = 0
    val_before_train: bool = True
    save_every: int = 0
    keep_last: int = 2
    max_skipped_updates_in_a_row: int = 5
    resume: str = "auto"
    output_dir: str = "outputs/rl"
    loggers: tuple[str, ...] = ("console", "jsonl")
    project: str = "tandem"
    experiment: str = "run"
    seed: int = 0
    report: bool = True
    report_every: int = 10
    export_hf: bool = True
    profile_steps: tuple[int, ...] = ()
    profile_dir: str = ""
    lr_schedule_unit: str = "optimizer_step"

    def __post_init__(self) -> None:
        check_range("trainer", "total_steps", self.total_steps, low=0)
        check_range("trainer", "report_every", self.report_every, low=0)
        for step in self.profile_steps:
            if not isinstance(step, int) or step < 1:
                raise ValueError(
                    f"trainer.profile_steps must hold step numbers >= 1, got {list(self.profile_steps)}"
                )
        check_positive("trainer", "total_epochs", self.total_epochs)
        check_device_setting("trainer", "device", self.device)
        check_choice("trainer", "backend", self.backend, BACKENDS)
        check_choice("trainer", "lr_schedule_unit", self.lr_schedule_unit, ["optimizer_step", "step"])
        check_positive("trainer", "n_workers", self.n_workers)
        check_positive("trainer", "nnodes", self.nnodes)
        check_range("trainer", "n_gpus_per_node", self.n_gpus_per_node, low=0)
        if self.n_gpus_per_node and self.n_workers not in (1, self.n_gpus_per_node):
            raise ValueError(
                f"trainer.n_gpus_per_node={self.n_gpus_per_node} sets one worker per GPU; leave trainer.n_workers "
                f"(={self.n_workers}) unset, it counts CPU workers"
            )
        if self.n_gpus_per_node and self.device == "cpu":
            raise ValueError(
                f"trainer.n_gpus_per_node={self.n_gpus_per_node} asks for GPUs but trainer.device='cpu'"
            )
        if self.nnodes > 1 and self.backend != "ray":
            raise ValueError(
                f"trainer.nnodes={self.nnodes} needs trainer.backend=ray (the local backend is one machine)"
            )
        for name in ("val_every", "save_every"):
            check_range("trainer", name, getattr(self, name), low=0)
        check_positive("trainer", "keep_last", self.keep_last)
        check_positive("trainer", "max_skipped_updates_in_a_row", self.max_skipped_updates_in_a_row)
        for logger in self.loggers:
            check_choice("trainer", "loggers", logger, LOGGERS)


@dataclass(frozen=True)
class TrainConfig:
    """Everything ``tandem train`` reads; ``model_path`` is the policy (and reference) HF directory."""

    model_path: str = ""
    data: RLDataConfig = field(default_factory=RLDataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required (a local HF model directory)")
        if not self.data.train_path:
            raise ValueError("data.train_path is required (a parquet file of prompts in verl's schema)")
        n, workers = self.rollout.n, self.world_size
        if self.algorithm.compares_groups and n < 2:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator!r} compares the responses of a prompt, "
                f"so rollout.n must be at least 2 (got {n})"
            )
        if self.algorithm.filter_groups.enable and n < 2:
            raise ValueError("algorithm.filter_groups.enable needs rollout.n >= 2")
        mini = self.mini_batch_prompts
        if self.data.train_batch_size % mini:
            raise ValueError(
                f"actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={self.data.train_batch_size}"
            )
        if (mini * n) % workers:
            raise ValueError(
                f"a mini-batch of actor.ppo_mini_batch_size * rollout.n = {mini * n} sequences must divide "
                f"evenly over the {workers} workers (trainer.nnodes x trainer.n_gpus_per_node or trainer.n_workers)"
            )
        longest = self.data.max_prompt_length + self.rollout.max_response_length
        engine = self.actor.engine
        if engine.use_packing and engine.max_tokens_per_micro_batch < longest:
            raise ValueError(
                f"actor.engine.max_tokens_per_micro_batch={engine.max_tokens_per_micro_batch} is below the longest "
                f"sequence, data.max_prompt_length + rollout.max_response_length = {longest}"
            )
        rollout = self.rollout.engine
        if engine.logprob_head_dtype == "bfloat16" and rollout.selected.dtype != "bfloat16":
            raise ValueError(
                f"actor.engine.logprob_head_dtype=bfloat16 rounds the head's inputs to bf16, but the rollout's "
                f"log-probs come from a {rollout.selected.dtype} model (rollout.engine.{rollout.name}.dtype): they "
                f"would disagree by that rounding; set rollout.engine.{rollout.name}.dtype=bfloat16 or keep the "
                "float32 head"
            )
        if self.algorithm.kl.use_kl_loss and self.algorithm.kl.kl_loss_coef == 0:
            raise ValueError("algorithm.kl.use_kl_loss is on but algorithm.kl.kl_loss_coef is 0")
        if "interaction" in self.reward.sources and not self.agent.interaction_path:
            raise ValueError(
                "reward.sources has 'interaction': set agent.interaction_path (the user function whose "
                "reward ends an episode) and agent.name=interaction"
            )
        self._check_pipeline()
        self._check_preference()
        self._check_critic()
        from tandem.rl.derived import check_derived_fields  # derived.py builds on this module

        check_derived_fields(self)

    def _check_preference(self) -> None:
        """Online DPO's constraints, named by key."""
        if not self.prefers:
            return
        objective = "actor.objective=preference"
        if self.rollout.n < 2:
            raise ValueError(f"{objective} ranks each prompt's responses, so rollout.n must be at least 2")
        if self.mini_batch_prompts != self.data.train_batch_size:
            raise ValueError(
                f"{objective} takes one optimizer step per step; leave actor.ppo_mini_batch_size unset"
            )
        if self.pipeline.disaggregated:
            raise ValueError(f"{objective} runs with pipeline.mode=sync for now")
        if self.algorithm.filter_groups.enable or self.algorithm.needs_greedy_baseline:
            raise ValueError(
                f"{objective} pairs responses itself: algorithm.filter_groups and the {self.algorithm.adv_estimator} "
                "baseline do not apply"
            )
        if self.algorithm.kl.use_kl_loss or self.algorithm.kl.use_kl_in_reward:
            raise ValueError(
                f"{objective}: the preference loss already measures the policy against the reference; "
                "turn algorithm.kl.use_kl_loss and use_kl_in_reward off"
            )

    def _check_critic(self) -> None:
        """The critic's batch sizes divide like the actor's, named by key."""
        if not self.uses_critic:
            return
        mini = self.critic_mini_batch_prompts
        if self.data.train_batch_size % mini:
            raise ValueError(
                f"critic.ppo_mini_batch_size={mini} must divide data.train_batch_size={self.data.train_batch_size}"
            )
        if (mini * self.rollout.n) % self.world_size:
            raise ValueError(
                f"a critic mini-batch of critic.ppo_mini_batch_size * rollout.n = {mini * self.rollout.n} sequences "
                f"must divide evenly over the {self.world_size} workers"
            )

    @property
    def uses_critic(self) -> bool:
        """A critic is trained (the advantage estimator reads values)."""
        return self.algorithm.needs_values and not self.prefers

    @property
    def critic_mini_batch_prompts(self) -> int:
        return self.critic.ppo_mini_batch_size or self.mini_batch_prompts

    @property
    def critic_epochs(self) -> int:
        return self.critic.ppo_epochs or self.actor.ppo_epochs

    @property
    def critic_loss_agg_mode(self) -> str:
        return self.critic.loss_agg_mode or self.actor.policy_loss.loss_agg_mode

    @property
    def prefers(self) -> bool:
        """Online DPO: the actor trains on best/worst response pairs (``actor.objective=preference``)."""
        return self.actor.objective == "preference"

    @property
    def needs_reference(self) -> bool:
        """Reference log-probs are computed: for a KL term, or for a preference loss that has one."""
        if self.prefers:
            return self.actor.preference.needs_reference
        return self.algorithm.needs_reference

    def _check_pipeline(self) -> None:
        """What the asynchronous pipelines do not support (yet), named by key."""
        pipeline = self.pipeline
        if not pipeline.disaggregated:
            return
        mode = f"pipeline.mode={pipeline.mode}"
        if self.algorithm.filter_groups.enable:
            raise ValueError(f"{mode} does not support algorithm.filter_groups.enable (dynamic sampling) yet")
        if self.algorithm.needs_greedy_baseline:
            raise ValueError(
                f"{mode} does not support algorithm.adv_estimator={self.algorithm.adv_estimator} "
                "(a greedy baseline per prompt) yet"
            )
        if self.rollout.free_cache_between_generations:
            raise ValueError(
                f"{mode} generates continuously; rollout.free_cache_between_generations must be off"
            )
        offload = self.actor.offload
        if offload.params or offload.optimizer:
            key = "actor.offload.params" if offload.params else "actor.offload.optimizer"
            raise ValueError(
                f"{mode} generates on replicas of its own, so the trainer never waits on a generation; "
                f"{key} frees memory for a colocated rollout and must be off (actor.offload.reference may stay on)"
            )
        if pipeline.old_log_probs == "rollout" and self.algorithm.needs_sum_pi_squared:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs sum_pi_squared from a trainer forward, "
                "which pipeline.old_log_probs=rollout skips; use pipeline.old_log_probs=recompute"
            )
        if pipeline.old_log_probs == "rollout" and (self.rollout.top_p < 1.0 or self.rollout.top_k):
            raise ValueError(
                f"pipeline.old_log_probs=rollout needs untruncated sampling (rollout.top_p=1, rollout.top_k=0; got "
                f"{self.rollout.top_p}, {self.rollout.top_k}): truncation changes the rollout's log-probs"
            )
        lag = pipeline.trigger_parameter_sync_step - 1
        if pipeline.mode == "fully_async" and pipeline.staleness_threshold < lag:
            raise ValueError(
                f"pipeline.staleness_threshold={pipeline.staleness_threshold} is below pipeline."
                f"trigger_parameter_sync_step - 1 = {lag}: between syncs the trainer would wait for samples "
                "that the threshold forbids the rollout to start"
            )

    @property
    def workers_per_node(self) -> int:
        return self.trainer.n_gpus_per_node or self.trainer.n_workers

    @property
    def world_size(self) -> int:
        """Data-parallel workers in all: ``nnodes * (n_gpus_per_node or n_workers)``."""
        return self.trainer.nnodes * self.workers_per_node

    @property
    def gpus_per_worker(self) -> float:
        """What every pool of the run reserves per process: one GPU on GPUs, none on CPU workers."""
        return 1.0 if self.trainer.n_gpus_per_node else 0.0

    def resource_pool(self) -> ResourcePool:
        """The workers' placement: ``workers_per_node`` on each of ``nnodes`` nodes, one GPU each on GPUs."""
        return ResourcePool(
            (self.workers_per_node,) * self.trainer.nnodes,
            gpus_per_process=self.gpus_per_worker,
            name="actor_rollout_ref",
        )

    def critic_resource_pool(self) -> ResourcePool:
        """The critic group's placement: the actor's shape, in a pool of its own (with Ray, GPUs of its
        own; the local backend binds critic rank ``r`` to actor rank ``r``'s device)."""
        return dataclasses.replace(self.resource_pool(), name="critic")

    def reward_model_resource_pool(self) -> ResourcePool:
        """The reward-model scorers' placement: ``reward.model.n_workers`` on the first node, one
        GPU each on GPUs."""
        return ResourcePool(
            (self.reward.model.n_workers,),
            gpus_per_process=self.gpus_per_worker,
            name="reward_model",
        )

    def rollout_resource_pool(self) -> ResourcePool:
        """The rollout replicas' placement (every pipeline mode but ``sync``): ``pipeline.rollout_replicas``
        processes, one GPU each on GPUs."""
        return ResourcePool(
            (self.pipeline.rollout_replicas,),
            gpus_per_process=self.gpus_per_worker,
            name="rollout",
        )

    def resource_pools(self) -> list[ResourcePool]:
        """Every pool the run places: the actor's, and the critic's, the reward model's and the rollout
        replicas' when the run has them apart from the actor."""
        pools = [self.resource_pool()]
        if self.uses_critic and self.critic.placement != "colocated":
            pools.append(self.critic_resource_pool())
        if "model" in self.reward.sources:
            pools.append(self.reward_model_resource_pool())
        if self.pipeline.disaggregated:
            pools.append(self.rollout_resource_pool())
        return pools

    def schedule_steps(self, total_steps: int, epochs: int, mini_batch_prompts: int) -> int:
        """Learning-rate schedule steps over a run of ``total_steps`` RL steps (``trainer.lr_schedule_unit``)."""
        if self.trainer.lr_schedule_unit == "step":
            return total_steps
        return total_steps * epochs * (self.data.train_batch_size // mini_batch_prompts)

    @property
    def mini_batch_prompts(self) -> int:
        return self.actor.ppo_mini_batch_size or self.data.train_batch_size

    @property
    def needs_old_log_probs(self) -> bool:
        """PPO's old log-probs are used (not by online DPO, whose loss compares to the reference)."""
        return not self.prefers

    @property
    def old_log_probs_from_update(self) -> bool:
        """True when the step is purely on-policy, so the update's forward gives the old log-probs
        (never when the advantage estimator reads them, since it runs before the update)."""
        correction = self.algorithm.rollout_correction
        return (
            not self.pipeline.disaggregated  # replicas lag the trainer: old log-probs are recomputed
            and not self.algorithm.advantages_need_old_log_probs
            and not self.actor.recompute_old_log_probs
            and self.actor.ppo_epochs == 1
            and self.mini_batch_prompts == self.data.train_batch_size
            and not self.algorithm.kl.use_kl_in_reward
            and correction.is_level == "none"
            and correction.rejection == "none"
            and correction.veto_threshold is None
        )

    @property
    def old_log_probs_from_rollout(self) -> bool:
        """True when an asynchronous pipeline takes PPO's old log-probs from the rollout (``pipeline.old_log_probs``)."""
        return self.pipeline.disaggregated and self.pipeline.old_log_probs == "rollout"

    @property
    def max_sequence_length(self) -> int:
        return self.data.max_prompt_length + self.rollout.max_response_length
