"""The table of verl keys tandem reads: each key, verl's default, and what it becomes.

Three kinds of key:

* **mapped** — the value becomes one or more tandem keys (``to``, converted by ``convert``);
  several keys that only make sense together (micro-batch sizes, clip ratios, the KL type,
  devices, ...) are ``joint``: :mod:`tandem.verl.joint` reads them as a group.
* **noted** — meaningless here (memory and speed knobs tandem decides itself, such as
  offloading or tensor parallelism): accepted, and the translation prints ``note``.
* **required value** — a feature tandem does not have: accepted only at the value that
  leaves it off (``only``); any other value is an error naming the key.

A verl key missing from the table is an error too. verl's defaults (``default``) are applied
for every mapped key the command leaves out, so a translated run starts from verl's
settings, not tandem's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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


def _same(value: Any) -> Any:
    return value


def _off_if_negative(value: Any) -> int:
    """verl's ``-1``/``null`` (off, unlimited) -> tandem's 0."""
    return 0 if value is None or int(value) < 0 else int(value)


def _named(key: str) -> Callable[[Any], str]:
    return lambda value: names.tandem_name(key, value)


def _comma_list(value: Any) -> str:
    return ",".join(value) if isinstance(value, (list, tuple)) else str(value)


def mapped(
    key: str,
    to: str,
    default: Any = MISSING,
    convert: Callable[[Any], Any] = _same,
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


def _with_loss(*modes: str) -> tuple[str, tuple]:
    return (f"{ACTOR}.policy_loss.loss_mode", modes)


_WITH_KL_PENALTY = (f"{ALGO}.use_kl_in_reward", (True,))
_WITH_LORA = (f"{MODEL}.lora_rank", tuple(range(1, 4097)))

_MEMORY = "a memory or speed setting; tandem decides it itself and the results do not depend on it"
_OFFLOAD = "offloading within a phase: tandem keeps what a phase computes with on the worker's device"
_LOGPROB_MICRO = "forward-only passes use the actor's micro-batch budget in tandem"
_SEQUENCE_PARALLEL = "tandem has no sequence parallelism: each worker holds whole sequences (memory only)"
_RAY = "tandem starts Ray itself (trainer.backend=ray)"

RULES: tuple[Rule, ...] = (
    # ---- data ----
    joint("data.train_files", "data.train_path (one file)", example="/data/train.parquet"),
    joint("data.val_files", "data.val_path (one file)", example="/data/test.parquet"),
    mapped("data.train_batch_size", "data.train_batch_size", 1024, int, example=8),
    mapped("data.max_prompt_length", "data.max_prompt_length", 512, int),
    mapped("data.max_response_length", "rollout.max_response_length", 512, int),
    joint("data.filter_overlong_prompts", "data.overlong_prompts", False),
    joint("data.truncation", "data.overlong_prompts", "error", example="left"),
    mapped("data.shuffle", "data.shuffle", True, bool),
    mapped("data.val_max_samples", "data.val_max_samples", -1, _off_if_negative, example=64),
    only("data.train_max_samples", (-1, None), "a cap on training prompts (cut the file instead)"),
    only("data.prompt_key", ("prompt",), "prompt columns other than verl's 'prompt'"),
    only("data.reward_fn_key", ("data_source",), "choosing the scorer by a column other than 'data_source'"),
    only("data.tokenizer", (None,), "a tokenizer apart from the model directory"),
    only("data.custom_cls.path", (None,), "custom dataset classes"),
    only("data.apply_chat_template_kwargs", ({},), "chat-template arguments"),
    noted(
        "data.gen_batch_size",
        "with dynamic sampling tandem generates data.train_batch_size prompts per round",
        96,
    ),
    noted("data.val_batch_size", "tandem validates all prompts at once"),
    noted("data.seed", "the data order follows trainer.seed"),
    noted("data.dataloader_num_workers", _MEMORY),
    noted("data.filter_overlong_prompts_workers", _MEMORY),
    noted("data.return_raw_chat", "tandem keeps the raw chat of each prompt"),
    noted("data.return_full_prompt", "not needed by tandem's trainer"),
    noted("data.use_shm", _MEMORY),
    noted("data.trust_remote_code", "tandem loads tokenizers without remote code"),
    noted("data.validation_shuffle", "validation order does not change its scores"),
    # ---- model ----
    mapped(f"{MODEL}.path", "model_path", example="/models/qwen"),
    mapped(f"{MODEL}.enable_gradient_checkpointing", "actor.engine.gradient_checkpointing", True, bool),
    mapped(f"{MODEL}.lora_rank", "actor.engine.lora.rank", 0, int, example=8),
    mapped(f"{MODEL}.lora_alpha", "actor.engine.lora.alpha", 16, float, example=32, when=_WITH_LORA),
    mapped(
        f"{MODEL}.target_modules",
        "actor.engine.lora.target_modules",
        "all-linear",
        _comma_list,
        when=_WITH_LORA,
    ),
    joint(
        f"{MODEL}.override_config.max_position_embeddings",
        "nothing (a length limit, not math)",
        example=32768,
    ),
    noted(f"{MODEL}.use_remove_padding", "tandem always packs sequences without padding"),
    noted(f"{MODEL}.use_liger", _MEMORY),
    noted(f"{MODEL}.use_fused_kernels", _MEMORY),
    noted(f"{MODEL}.use_shm", _MEMORY),
    noted(f"{MODEL}.enable_activation_offload", _OFFLOAD),
    noted(f"{MODEL}.trust_remote_code", "tandem loads the model with transformers' built-in classes"),
    only(f"{MODEL}.external_lib", (None,), "external model libraries"),
    only(
        f"{MODEL}.custom_chat_template", (None,), "a custom chat template: put it in the tokenizer's config"
    ),
    only(f"{MODEL}.tokenizer_path", (None,), "a tokenizer apart from the model directory"),
    only(f"{MODEL}.hf_config_path", (None,), "a model config apart from the model directory"),
    only(f"{MODEL}.lora_adapter_path", (None,), "starting from a saved LoRA adapter"),
    # ---- actor: optimizer ----
    mapped(f"{ACTOR}.optim.lr", "actor.engine.lr", 1e-6, float),
    mapped(f"{ACTOR}.optim.weight_decay", "actor.engine.weight_decay", 0.01, float),
    mapped(f"{ACTOR}.optim.betas", "actor.engine.betas", [0.9, 0.999], lambda v: tuple(float(b) for b in v)),
    joint(f"{ACTOR}.optim.clip_grad", "actor.engine.grad_clip (verl's v1 trainer)", 1.0, example=0.5),
    joint(f"{ACTOR}.grad_clip", "actor.engine.grad_clip (verl's legacy trainer)", 1.0, example=0.5),
    joint(f"{ACTOR}.optim.lr_warmup_steps", "actor.engine.warmup_steps", -1, example=10),
    joint(f"{ACTOR}.optim.lr_warmup_steps_ratio", "actor.engine.warmup_ratio", 0.0, example=0.1),
    joint(f"{ACTOR}.optim.lr_scheduler_type", "actor.engine.lr_schedule", "constant", example="cosine"),
    joint(f"{ACTOR}.optim.warmup_style", "actor.engine.lr_schedule (verl's older name)", example="cosine"),
    mapped(
        f"{ACTOR}.optim.min_lr_ratio",
        "actor.engine.min_lr_ratio",
        0.0,
        lambda v: 0.0 if v is None else float(v),
    ),
    only(f"{ACTOR}.optim.num_cycles", (0.5,), "cosine schedules other than one half-cosine"),
    only(f"{ACTOR}.optim.optimizer", ("AdamW",), "optimizers other than AdamW"),
    only(f"{ACTOR}.optim.total_training_steps", (-1, None), "a schedule length apart from the run's"),
    only(f"{ACTOR}.optim.override_optimizer_config", (None, {}), "optimizer overrides"),
    noted(f"{ACTOR}.optim.optimizer_impl", "tandem uses torch.optim.AdamW"),
    # ---- actor: batches ----
    mapped(f"{ACTOR}.ppo_mini_batch_size", "actor.ppo_mini_batch_size", 256, int, example=2),
    joint(f"{ACTOR}.ppo_micro_batch_size", "actor.engine.max_tokens_per_micro_batch (÷ workers)", example=16),
    joint(f"{ACTOR}.ppo_micro_batch_size_per_gpu", "actor.engine.max_tokens_per_micro_batch", example=4),
    joint(f"{ACTOR}.use_dynamic_bsz", "actor.engine.max_tokens_per_micro_batch", False, example=True),
    joint(
        f"{ACTOR}.ppo_max_token_len_per_gpu", "actor.engine.max_tokens_per_micro_batch", 16384, example=3000
    ),
    mapped(f"{ACTOR}.ppo_epochs", "actor.ppo_epochs", 1, int),
    mapped(f"{ACTOR}.shuffle", "actor.shuffle_mini_batches", False, bool),
    # ---- actor: loss ----
    joint(f"{ACTOR}.policy_loss.loss_mode", "actor.policy_loss.name", "vanilla", example="gspo"),
    joint(f"{ACTOR}.clip_ratio", "actor.policy_loss.clip_ratio_low/high", 0.2),
    joint(f"{ACTOR}.clip_ratio_low", "actor.policy_loss.clip_ratio_low", example=0.1),
    joint(f"{ACTOR}.clip_ratio_high", "actor.policy_loss.clip_ratio_high", example=0.28),
    joint(f"{ACTOR}.clip_ratio_c", "actor.policy_loss.clip_ratio_c", 3.0, example=10.0),
    joint(
        f"{ACTOR}.loss_agg_mode",
        "actor.policy_loss.loss_agg_mode",
        "token-mean",
        example="seq-mean-token-mean",
    ),
    mapped(
        f"{ACTOR}.loss_scale_factor",
        "actor.policy_loss.norm_length",
        None,
        lambda v: None if v is None else float(v),
        example=4096,
    ),
    mapped(f"{ACTOR}.tau_pos", "actor.policy_loss.sapo_tau_pos", 1.0, float, when=_with_loss("sapo")),
    mapped(f"{ACTOR}.tau_neg", "actor.policy_loss.sapo_tau_neg", 1.05, float, when=_with_loss("sapo")),
    mapped(
        f"{ACTOR}.policy_loss.clip_cov_ratio",
        "actor.policy_loss.clip_cov_ratio",
        2e-4,
        float,
        when=_with_loss("clip_cov"),
    ),
    mapped(
        f"{ACTOR}.policy_loss.clip_cov_lb",
        "actor.policy_loss.clip_cov_lb",
        1.0,
        float,
        when=_with_loss("clip_cov"),
    ),
    mapped(
        f"{ACTOR}.policy_loss.clip_cov_ub",
        "actor.policy_loss.clip_cov_ub",
        5.0,
        float,
        when=_with_loss("clip_cov"),
    ),
    mapped(
        f"{ACTOR}.policy_loss.kl_cov_ratio",
        "actor.policy_loss.kl_cov_ratio",
        2e-4,
        float,
        when=_with_loss("kl_cov"),
    ),
    mapped(
        f"{ACTOR}.policy_loss.ppo_kl_coef",
        "actor.policy_loss.kl_cov_coef",
        0.1,
        float,
        when=_with_loss("kl_cov"),
    ),
    joint(f"{ACTOR}.policy_loss.dro_beta", "actor.policy_loss.dro_beta", example=0.5),
    mapped(f"{ACTOR}.entropy_coeff", "actor.entropy_coeff", 0.0, float),
    mapped(f"{ACTOR}.use_kl_loss", "algorithm.kl.use_kl_loss", False, bool),
    mapped(
        f"{ACTOR}.kl_loss_coef",
        "algorithm.kl.kl_loss_coef",
        0.001,
        float,
        when=(f"{ACTOR}.use_kl_loss", (True,)),
    ),
    joint(f"{ACTOR}.kl_loss_type", "algorithm.kl.estimator", "low_var_kl", example="k3+"),
    noted(f"{ACTOR}.calculate_entropy", "tandem logs the entropy on every step"),
    noted(f"{ACTOR}.calculate_sum_pi_squared", "tandem computes Σπ² when the estimator needs it"),
    # ---- actor: engine knobs ----
    joint(f"{ACTOR}.fsdp_config.model_dtype", "actor.engine.param_dtype", "fp32", example="bf16"),
    joint(f"{ACTOR}.fsdp_config.dtype", "actor.engine.mixed_precision", "bfloat16"),
    noted(f"{ACTOR}.strategy", "tandem picks DDP or FSDP2 by the number of workers"),
    noted(f"{ACTOR}.fsdp_config.strategy", "tandem picks DDP or FSDP2 by the number of workers"),
    mapped(f"{ACTOR}.fsdp_config.param_offload", "actor.offload.params", False, bool, example=True),
    mapped(f"{ACTOR}.fsdp_config.optimizer_offload", "actor.offload.optimizer", False, bool, example=True),
    noted(f"{ACTOR}.fsdp_config.offload_policy", _OFFLOAD),
    noted(f"{ACTOR}.fsdp_config.reshard_after_forward", _MEMORY),
    noted(f"{ACTOR}.fsdp_config.fsdp_size", _MEMORY),
    noted(f"{ACTOR}.fsdp_config.forward_prefetch", _MEMORY),
    noted(f"{ACTOR}.fsdp_config.wrap_policy.min_num_params", _MEMORY),
    noted(f"{ACTOR}.fsdp_config.use_orig_params", _MEMORY),
    noted(f"{ACTOR}.fsdp_config.use_torch_compile", _MEMORY),
    noted(f"{ACTOR}.fsdp_config.seed", "initialisation follows trainer.seed"),
    noted(f"{ACTOR}.ulysses_sequence_parallel_size", _SEQUENCE_PARALLEL),
    noted(f"{ACTOR}.use_torch_compile", _MEMORY),
    noted(f"{ACTOR}.entropy_from_logits_with_chunking", _MEMORY),
    noted(f"{ACTOR}.entropy_checkpointing", _MEMORY),
    noted(f"{ACTOR}.use_fused_kernels", _MEMORY),
    noted(f"{ACTOR}.use_remove_padding", "tandem always packs sequences without padding"),
    noted(f"{ACTOR}.data_loader_seed", "mini-batch order follows trainer.seed"),
    noted(f"{ACTOR}.checkpoint.save_contents", "tandem saves model, optimizer and trainer state"),
    noted(f"{ACTOR}.checkpoint.load_contents", "tandem loads model, optimizer and trainer state"),
    noted(f"{ACTOR}.checkpoint.async_save", _MEMORY),
    noted(f"{ACTOR}.profiler.enable", "use trainer.profile_steps (tandem's PyTorch profiler)"),
    only(
        f"{ACTOR}.use_prefix_grouper",
        (False,),
        "verl's prefix grouper (tandem shares prompts by actor.engine.share_prompts)",
    ),
    only(f"{ACTOR}.fsdp_config.qat.enable", (False,), "quantisation-aware training"),
    only(f"{ACTOR}.router_replay.mode", ("disabled",), "MoE router replay"),
    # ---- reference ----
    noted(f"{REF}.log_prob_micro_batch_size", _LOGPROB_MICRO),
    noted(f"{REF}.log_prob_micro_batch_size_per_gpu", _LOGPROB_MICRO),
    noted(f"{REF}.log_prob_use_dynamic_bsz", _LOGPROB_MICRO),
    noted(f"{REF}.log_prob_max_token_len_per_gpu", _LOGPROB_MICRO),
    mapped(f"{REF}.fsdp_config.param_offload", "actor.offload.reference", False, bool, example=True),
    noted(f"{REF}.fsdp_config.reshard_after_forward", _MEMORY),
    noted(f"{REF}.fsdp_config.wrap_policy.min_num_params", _MEMORY),
    noted(f"{REF}.ulysses_sequence_parallel_size", _SEQUENCE_PARALLEL),
    noted(f"{REF}.strategy", "tandem picks DDP or FSDP2 by the number of workers"),
    noted(f"{REF}.use_torch_compile", _MEMORY),
    noted(f"{REF}.entropy_from_logits_with_chunking", _MEMORY),
    noted(f"{REF}.entropy_checkpointing", _MEMORY),
    # ---- rollout ----
    joint(f"{ROLLOUT}.name", "rollout.engine.name", example="vllm"),
    mapped(f"{ROLLOUT}.n", "rollout.n", 1, int, example=5),
    mapped(f"{ROLLOUT}.temperature", "rollout.temperature", 1.0, float),
    mapped(f"{ROLLOUT}.top_p", "rollout.top_p", 1.0, float),
    mapped(f"{ROLLOUT}.top_k", "rollout.top_k", -1, _off_if_negative, example=20),
    only(f"{ROLLOUT}.do_sample", (True,), "greedy training rollouts"),
    joint(f"{ROLLOUT}.val_kwargs.temperature", "rollout.val_temperature", 0.0, example=0.6),
    joint(f"{ROLLOUT}.val_kwargs.top_p", "rollout.val_top_p", 1.0, example=0.7),
    joint(f"{ROLLOUT}.val_kwargs.top_k", "rollout.val_top_k", -1, example=20),
    joint(f"{ROLLOUT}.val_kwargs.n", "rollout.val_n", 1, example=4),
    joint(f"{ROLLOUT}.val_kwargs.do_sample", "rollout.val_temperature (0 when false)", False, example=True),
    joint(f"{ROLLOUT}.gpu_memory_utilization", "rollout.engine.vllm.gpu_memory_utilization", example=0.6),
    joint(
        f"{ROLLOUT}.enforce_eager",
        "rollout.engine.vllm.enforce_eager (the native engine: cuda_graphs, negated)",
        example=True,
    ),
    joint(f"{ROLLOUT}.enable_prefix_caching", "rollout.engine.vllm.enable_prefix_caching", example=True),
    joint(f"{ROLLOUT}.max_num_seqs", "rollout.engine.<name>.max_num_seqs", example=128),
    joint(f"{ROLLOUT}.dtype", "rollout.engine.vllm.dtype (native, hf: their own dtype)", example="bfloat16"),
    joint(f"{ROLLOUT}.logprobs_mode", "rollout.engine.vllm.logprobs_mode", "processed_logprobs"),
    only(
        f"{ROLLOUT}.multi_turn.enable",
        (False,),
        "multi-turn tool rollouts (agent loops are not in tandem yet)",
    ),
    only(f"{ROLLOUT}.over_sample_rate", (0, 0.0), "over-sampling rollouts"),
    only(f"{ROLLOUT}.ignore_eos", (False,), "generation past the end-of-sequence token"),
    only(f"{ROLLOUT}.disaggregation.enabled", (False,), "prefill/decode disaggregation"),
    noted(f"{ROLLOUT}.mode", "tandem's rollout engines serve requests asynchronously"),
    noted(f"{ROLLOUT}.tensor_model_parallel_size", "tandem's vLLM replica runs on one GPU (memory only)"),
    noted(f"{ROLLOUT}.data_parallel_size", _MEMORY),
    noted(f"{ROLLOUT}.expert_parallel_size", _MEMORY),
    noted(f"{ROLLOUT}.pipeline_model_parallel_size", _MEMORY),
    noted(f"{ROLLOUT}.enable_chunked_prefill", _MEMORY),
    noted(f"{ROLLOUT}.max_num_batched_tokens", _MEMORY),
    noted(f"{ROLLOUT}.max_model_len", "the engine's longest sequence follows the data's lengths"),
    noted(f"{ROLLOUT}.prompt_length", "follows data.max_prompt_length"),
    noted(f"{ROLLOUT}.response_length", "follows data.max_response_length"),
    noted(f"{ROLLOUT}.free_cache_engine", "see rollout.free_cache_between_generations (memory only)"),
    noted(f"{ROLLOUT}.load_format", "tandem loads the rollout's weights from the trainer"),
    noted(f"{ROLLOUT}.layered_summon", _MEMORY),
    noted(f"{ROLLOUT}.calculate_log_probs", "the rollout's log-probs are always returned"),
    noted(f"{ROLLOUT}.seed", "sampling seeds follow trainer.seed"),
    noted(f"{ROLLOUT}.cudagraph_capture_sizes", _MEMORY),
    noted(f"{ROLLOUT}.disable_log_stats", "tandem logs rollout statistics in its own metrics"),
    noted(f"{ROLLOUT}.log_prob_micro_batch_size", _LOGPROB_MICRO),
    noted(f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu", _LOGPROB_MICRO),
    noted(f"{ROLLOUT}.log_prob_use_dynamic_bsz", _LOGPROB_MICRO),
    noted(f"{ROLLOUT}.log_prob_max_token_len_per_gpu", _LOGPROB_MICRO),
    noted(f"{ROLLOUT}.checkpoint_engine.update_weights_bucket_megabytes", _MEMORY),
    noted(f"{ROLLOUT}.checkpoint_engine.backend", "tandem picks the weight-sync transport per pipeline"),
    noted(f"{ROLLOUT}.agent.num_workers", "no agent loops in tandem yet"),
    noted(f"{ARF}.hybrid_engine", "tandem colocates actor and rollout in pipeline.mode=sync"),
    noted(f"{ARF}.nccl_timeout", "tandem's collectives use their own timeouts"),
    # ---- algorithm ----
    mapped(
        f"{ALGO}.adv_estimator",
        "algorithm.adv_estimator",
        "gae",
        _named(f"{ALGO}.adv_estimator"),
        example="grpo",
    ),
    mapped(f"{ALGO}.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std", True, bool),
    mapped(f"{ALGO}.gamma", "algorithm.gamma", 1.0, float),
    mapped(f"{ALGO}.lam", "algorithm.lam", 1.0, float),
    mapped(f"{ALGO}.use_kl_in_reward", "algorithm.kl.use_kl_in_reward", False, bool),
    joint(f"{ALGO}.kl_penalty", "algorithm.kl.estimator", "kl", example="low_var_kl"),
    mapped(
        f"{ALGO}.kl_ctrl.type",
        "algorithm.kl.controller",
        "fixed",
        _named(f"{ALGO}.kl_ctrl.type"),
        example="adaptive",
        when=_WITH_KL_PENALTY,
    ),
    mapped(f"{ALGO}.kl_ctrl.kl_coef", "algorithm.kl.coef", 0.001, float, when=_WITH_KL_PENALTY),
    mapped(f"{ALGO}.kl_ctrl.horizon", "algorithm.kl.horizon", 10000, int, when=_WITH_KL_PENALTY),
    mapped(f"{ALGO}.kl_ctrl.target_kl", "algorithm.kl.target_kl", 0.1, float, when=_WITH_KL_PENALTY),
    mapped(f"{ALGO}.filter_groups.enable", "algorithm.filter_groups.enable", False, bool),
    joint(
        f"{ALGO}.filter_groups.max_num_gen_batches",
        "algorithm.filter_groups.max_num_gen_batches",
        0,
        example=10,
    ),
    joint(
        f"{ALGO}.filter_groups.metric",
        "algorithm.filter_groups.metric (score: raw_score)",
        None,
        example="acc",
    ),
    noted(f"{ALGO}.filter_groups.max_inflight_gen_batches", "tandem generates one round at a time"),
    mapped(
        f"{ALGO}.gdpo_reward_keys",
        "algorithm.gdpo_reward_keys",
        example=["format", "accuracy"],
        convert=lambda v: tuple(v or ()),
    ),
    mapped(
        f"{ALGO}.gdpo_reward_weights",
        "algorithm.gdpo_reward_weights",
        example=[1.0, 2.0],
        convert=lambda v: tuple(float(w) for w in v or ()),
    ),
    joint(
        f"{ALGO}.rollout_correction.rollout_is",
        "algorithm.rollout_correction.is_level",
        None,
        example="sequence",
    ),
    mapped(
        f"{ALGO}.rollout_correction.rollout_is_threshold",
        "algorithm.rollout_correction.is_threshold",
        2.0,
        float,
        when=(f"{ALGO}.rollout_correction.rollout_is", ("token", "sequence")),
    ),
    joint(
        f"{ALGO}.rollout_correction.rollout_rs",
        "algorithm.rollout_correction.rejection",
        None,
        example="token_k1",
    ),
    joint(
        f"{ALGO}.rollout_correction.rollout_rs_threshold",
        "algorithm.rollout_correction.rejection_low/high",
        None,
        example="0.8_1.5",
    ),
    only(
        f"{ALGO}.rollout_correction.bypass_mode",
        (False,),
        "bypass mode (the rollout's log-probs as PPO's old ones: see pipeline.old_log_probs)",
    ),
    only(f"{ALGO}.rollout_correction.rollout_is_batch_normalize", (False,), "batch-normalised IS weights"),
    noted(f"{ALGO}.rollout_correction.loss_type", "tandem's policy loss is actor.policy_loss.loss_mode"),
    only(f"{ALGO}.use_pf_ppo", (False,), "PF-PPO reweighting"),
    # ---- reward ----
    joint("custom_reward_function.path", "reward.custom_path", example="/work/reward.py"),
    joint("custom_reward_function.name", "reward.custom_name", example="score_fn"),
    joint("reward.custom_reward_function.path", "reward.custom_path", example="/work/reward.py"),
    joint("reward.custom_reward_function.name", "reward.custom_name", example="score_fn"),
    joint("reward_model.reward_manager", "reward.overlong.enable (dapo)", example="dapo"),
    joint("reward.reward_manager.name", "reward.overlong.enable (dapo)", example="dapo"),
    joint("reward.reward_kwargs.overlong_buffer_cfg.enable", "reward.overlong.enable", example=True),
    joint("reward.reward_kwargs.overlong_buffer_cfg.len", "reward.overlong.buffer", example=48),
    joint(
        "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor",
        "reward.overlong.penalty_factor",
        example=0.5,
    ),
    joint("reward.reward_kwargs.max_resp_len", "must equal data.max_response_length", example=512),
    joint("reward_model.overlong_buffer.enable", "reward.overlong.enable", example=True),
    joint("reward_model.overlong_buffer.len", "reward.overlong.buffer", example=48),
    joint("reward_model.overlong_buffer.penalty_factor", "reward.overlong.penalty_factor", example=0.5),
    noted("reward.reward_kwargs.overlong_buffer_cfg.log", "tandem always logs reward/overlong_penalty_mean"),
    noted("reward_model.overlong_buffer.log", "tandem always logs reward/overlong_penalty_mean"),
    joint("reward.num_workers", "reward.num_workers", example=8),
    joint("reward_model.num_workers", "reward.num_workers", example=8),
    joint(
        "reward_model.enable",
        "reward.sources=[model] (the model's score replaces the rule's)",
        False,
        example=True,
    ),
    joint("reward_model.model.path", "reward.model.path", example="/models/rm"),
    joint("reward_model.max_length", "reward.model.max_length", example=1024),
    noted(
        "reward_model.model.input_tokenizer", "tandem always re-renders with the reward model's own tokenizer"
    ),
    noted(
        "reward_model.micro_batch_size_per_gpu",
        "tandem's token budget: reward.model.max_tokens_per_micro_batch",
    ),
    joint(
        "reward.reward_model.enable",
        "reward.sources=[model] (the model's score replaces the rule's)",
        False,
        example=True,
    ),
    joint("reward.reward_model.model_path", "reward.model.path", example="/models/rm"),
    only("sandbox_fusion.url", (None,), "sandbox code execution"),
    # ---- critic (read when the estimator reads values: gae) ----
    joint("critic.model.path", "critic.model_path (unset: the policy's)", example="/models/critic"),
    joint(
        "critic.model.enable_gradient_checkpointing",
        "critic.engine.gradient_checkpointing",
        True,
        example=False,
    ),
    joint("critic.optim.lr", "critic.engine.lr", 1e-5, example=2e-5),
    joint("critic.optim.weight_decay", "critic.engine.weight_decay", 0.01, example=0.1),
    joint("critic.optim.betas", "critic.engine.betas", [0.9, 0.999], example=[0.9, 0.95]),
    joint("critic.optim.clip_grad", "critic.engine.grad_clip (verl's v1 trainer)", 1.0, example=0.5),
    joint("critic.grad_clip", "critic.engine.grad_clip (verl's legacy trainer)", 1.0, example=0.5),
    joint("critic.optim.lr_warmup_steps", "critic.engine.warmup_steps", -1, example=5),
    joint("critic.optim.lr_warmup_steps_ratio", "critic.engine.warmup_ratio", 0.0, example=0.1),
    joint("critic.optim.lr_scheduler_type", "critic.engine.lr_schedule", "constant", example="cosine"),
    joint("critic.optim.warmup_style", "critic.engine.lr_schedule (verl's older name)", example="cosine"),
    joint("critic.optim.min_lr_ratio", "critic.engine.min_lr_ratio", 0.0, example=0.1),
    joint("critic.ppo_mini_batch_size", "critic.ppo_mini_batch_size (unset: the actor's)", example=2),
    joint("critic.ppo_epochs", "critic.ppo_epochs (unset: the actor's)", example=2),
    joint("critic.loss_agg_mode", "critic.loss_agg_mode (unset: the actor's)", example="seq-mean-token-mean"),
    joint("critic.ppo_micro_batch_size_per_gpu", "critic.engine.max_tokens_per_micro_batch", example=3),
    joint("critic.ppo_micro_batch_size", "critic.engine.max_tokens_per_micro_batch (÷ workers)", example=3),
    joint(
        "critic.use_dynamic_bsz",
        "critic.engine.max_tokens_per_micro_batch (unset: the actor's use_dynamic_bsz)",
        example=True,
    ),
    joint(
        "critic.ppo_max_token_len_per_gpu", "critic.engine.max_tokens_per_micro_batch", 32768, example=3000
    ),
    joint("critic.cliprange_value", "critic.cliprange_value", 0.5, example=0.2),
    joint("trainer.critic_warmup", "critic.warmup_steps (k - 1)", 0, example=2),
    joint("critic.model.fsdp_config.param_offload", "critic.offload.params", False, example=True),
    joint("critic.model.fsdp_config.optimizer_offload", "critic.offload.optimizer", False, example=True),
    noted("critic.strategy", "tandem picks DDP or FSDP2 by the number of workers"),
    noted("critic.model.use_remove_padding", "tandem always packs sequences without padding"),
    noted("critic.forward_micro_batch_size_per_gpu", _LOGPROB_MICRO),
    noted("critic.forward_max_token_len_per_gpu", _LOGPROB_MICRO),
    noted("critic.ulysses_sequence_parallel_size", _SEQUENCE_PARALLEL),
    noted("critic.model.trust_remote_code", "tandem loads the model with transformers' built-in classes"),
    only("critic.shuffle", (False, None), "shuffled critic mini-batches"),
    only("critic.model.lora_rank", (0,), "a LoRA critic"),
    only("critic.enable", (None,), "turning the critic on or off apart from the estimator"),
    # ---- trainer ----
    mapped("trainer.total_epochs", "trainer.total_epochs", 30, int),
    mapped("trainer.total_training_steps", "trainer.total_steps", None, _off_if_negative, example=100),
    mapped("trainer.save_freq", "trainer.save_every", -1, _off_if_negative, example=20),
    mapped("trainer.test_freq", "trainer.val_every", -1, _off_if_negative, example=5),
    mapped("trainer.val_before_train", "trainer.val_before_train", True, bool),
    mapped("trainer.balance_batch", "trainer.balance_batch", True, bool),
    joint(
        "trainer.logger",
        "trainer.loggers (and jsonl)",
        ["console", "wandb"],
        example=["console", "tensorboard"],
    ),
    mapped("trainer.project_name", "trainer.project", "verl_examples", str),
    mapped("trainer.experiment_name", "trainer.experiment", "gsm8k", str),
    joint("trainer.default_local_dir", "trainer.output_dir", example="/ckpt/run"),
    joint("trainer.resume_mode", "trainer.resume", "auto", example="disable"),
    joint("trainer.resume_from_path", "trainer.resume", None, example="/ckpt/run/step_10"),
    joint("trainer.n_gpus_per_node", "trainer.n_gpus_per_node (CPU: trainer.n_workers)", 8, example=4),
    joint("trainer.nnodes", "trainer.nnodes", 1, example=2),
    joint("trainer.device", "trainer.device", example="cpu"),
    mapped(
        "trainer.max_actor_ckpt_to_keep",
        "trainer.keep_last",
        None,  # verl keeps every checkpoint
        example=3,
        convert=lambda v: 1_000_000 if v is None else int(v),
    ),
    only("trainer.val_only", (False,), "validation-only runs"),
    only("trainer.default_hdfs_dir", (None,), "HDFS checkpoint copies"),
    only(
        "trainer.v1.trainer_mode",
        ("sync",),
        "verl v1's asynchronous trainer modes (tandem's are pipeline.mode)",
    ),
    only("transfer_queue.enable", (False,), "verl's transfer queue"),
    only("distillation.enabled", (False,), "distillation"),
    noted("trainer.log_val_generations", "tandem's report shows validation scores"),
    noted("trainer.rollout_data_dir", "not written by tandem"),
    noted("trainer.validation_data_dir", "not written by tandem"),
    noted("trainer.esi_redundant_time", "tandem saves on trainer.save_freq"),
    noted("trainer.ray_wait_register_center_timeout", _RAY),
    noted("trainer.del_local_ckpt_after_load", "tandem keeps checkpoints by trainer.max_actor_ckpt_to_keep"),
    joint(
        "trainer.use_v1",
        "which clipping key is read (optim.clip_grad, or grad_clip when false)",
        True,
        example=False,
    ),
    noted("ray_kwargs.ray_init.num_cpus", _RAY),
    noted("ray_kwargs.ray_init.runtime_env.py_executable", _RAY),
    noted("global_profiler.tool", "use trainer.profile_steps (tandem's PyTorch profiler)"),
    noted("global_profiler.steps", "use trainer.profile_steps (tandem's PyTorch profiler)"),
)

BY_KEY: dict[str, Rule] = {rule.key: rule for rule in RULES}
DEFAULTS: dict[str, Any] = {rule.key: rule.default for rule in RULES if rule.default is not MISSING}


@dataclass
class Collected:
    """A verl command's keys, split by kind. ``values`` holds verl's defaults overlaid with the command's."""

    values: dict[str, Any]
    given: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
