"""Every verl key in the table translates as documented: mapped keys to their tandem key and
value, joint keys to the settings listed here, noted keys with a note, required-value keys
accepted at their value and refused at another (naming the key)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tandem.verl import translate
from tandem.verl.key_table import key_table_markdown
from tandem.verl.keys import MISSING, RULES
from tandem.verl.translate import render

BASE = [
    "actor_rollout_ref.model.path=/models/tiny",
    "data.train_files=/data/train.parquet",
    "actor_rollout_ref.rollout.name=native",
    "trainer.device=cpu",
    "trainer.n_gpus_per_node=1",
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=2",
    "data.train_batch_size=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
]

# Keys whose example needs other keys beside it.
GAE = ["algorithm.adv_estimator=gae"]
TEMPERATURE = ["actor_rollout_ref.rollout.val_kwargs.temperature=1.0"]
DAPO_MANAGER = ["reward.reward_manager.name=dapo"]
OVERLONG_ON = [*DAPO_MANAGER, "reward.reward_kwargs.overlong_buffer_cfg.enable=true"]
OLD_OVERLONG_ON = ["reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true"]
TOOL_LOOP = ["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]
MULTI_TURN_WITH_LOOP = (
    "max_assistant_turns",
    "max_user_turns",
    "format",
    "max_parallel_calls",
    "max_tool_response_length",
    "tool_response_truncate_side",
)
OLD_KWARGS_ON = [*DAPO_MANAGER, "reward_model.reward_kwargs.overlong_buffer_cfg.enable=true"]
CONTEXT = {
    **{r.key: GAE for r in RULES if r.key.startswith("critic.") or r.key == "trainer.critic_warmup"},
    # a sequence-parallel size of 2 splits over 2 workers
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ["trainer.n_gpus_per_node=2"],
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": ["trainer.n_gpus_per_node=2"],
    "critic.ulysses_sequence_parallel_size": [*GAE, "trainer.n_gpus_per_node=2"],
    "critic.ppo_max_token_len_per_gpu": [*GAE, "critic.use_dynamic_bsz=true"],
    "algorithm.gdpo_reward_keys": ["algorithm.adv_estimator=gdpo"],
    "algorithm.gdpo_reward_weights": [
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[format,accuracy]",
    ],
    "actor_rollout_ref.actor.policy_loss.dro_beta": ["actor_rollout_ref.actor.policy_loss.loss_mode=dro"],
    "algorithm.filter_groups.max_num_gen_batches": [
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
    ],
    "algorithm.filter_groups.metric": ["algorithm.filter_groups.enable=true"],
    "algorithm.rollout_correction.rollout_rs_threshold": ["algorithm.rollout_correction.rollout_rs=token_k1"],
    "algorithm.rollout_correction.rollout_rs": ["algorithm.rollout_correction.rollout_rs_threshold=2.0"],
    "reward.reward_kwargs.overlong_buffer_cfg.enable": [
        *DAPO_MANAGER,
        "reward.reward_kwargs.overlong_buffer_cfg.len=64",
    ],
    "reward.reward_kwargs.overlong_buffer_cfg.len": OVERLONG_ON,
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": [
        *OVERLONG_ON,
        "reward.reward_kwargs.overlong_buffer_cfg.len=64",
    ],
    "reward_model.overlong_buffer.enable": [
        "reward_model.reward_manager=dapo",
        "reward_model.overlong_buffer.len=64",
    ],
    "reward_model.overlong_buffer.len": OLD_OVERLONG_ON,
    "reward_model.overlong_buffer.penalty_factor": [*OLD_OVERLONG_ON, "reward_model.overlong_buffer.len=64"],
    "reward.reward_kwargs.max_resp_len": ["data.max_response_length=512"],
    "reward_model.enable": ["reward_model.model.path=/models/rm"],
    "reward_model.model.path": ["reward_model.enable=true"],
    "reward_model.max_length": ["reward_model.enable=true", "reward_model.model.path=/models/rm"],
    "reward.reward_model.enable": ["reward.reward_model.model_path=/models/rm"],
    "reward.reward_model.model_path": ["reward.reward_model.enable=true"],
    "trainer.resume_from_path": ["trainer.resume_mode=resume_path"],
    "trainer.use_v1": ["actor_rollout_ref.actor.grad_clip=0.3"],
    "custom_reward_function.name": ["custom_reward_function.path=/work/reward.py"],
    "reward.custom_reward_function.name": ["reward.custom_reward_function.path=/work/reward.py"],
    "actor_rollout_ref.rollout.val_kwargs.top_p": TEMPERATURE,
    "actor_rollout_ref.rollout.val_kwargs.top_k": TEMPERATURE,
    "actor_rollout_ref.rollout.val_kwargs.n": TEMPERATURE,
    **{f"actor_rollout_ref.rollout.multi_turn.{name}": TOOL_LOOP for name in MULTI_TURN_WITH_LOOP},
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": [
        *DAPO_MANAGER,
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
    ],
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": OLD_KWARGS_ON,
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": [
        *OLD_KWARGS_ON,
        "reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
    ],
    "reward_model.reward_kwargs.max_resp_len": ["data.max_response_length=512"],
    "actor_rollout_ref.actor.router_replay.mode": [
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"
    ],
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": [
        "actor_rollout_ref.actor.router_replay.mode=R3"
    ],
}

# What each joint key's example becomes (tandem key -> value), with CONTEXT beside it.
JOINT = {
    "transfer_queue.enable": {"dataplane.enabled": True},  # one node: the shm engine, tandem's default
    "data.train_files": {"data.train_path": "/data/train.parquet"},
    "actor_rollout_ref.actor.router_replay.mode": {"actor.router_replay": "rollout"},
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": {"actor.router_replay": "rollout"},
    "data.val_files": {"data.val_path": "/data/test.parquet"},
    "data.filter_overlong_prompts": {
        "data.overlong_prompts": "error"
    },  # verl's default: keep them, truncation=error
    "data.truncation": {"data.overlong_prompts": "truncate_left"},
    "actor_rollout_ref.model.override_config.max_position_embeddings": {},
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": {"actor.engine.sp_size": 2},
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": {"actor.engine.sp_size": 2},
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": {},  # the actor's size (1): nothing to write
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size": {},
    "critic.ulysses_sequence_parallel_size": {"critic.engine.sp_size": 2},
    "actor_rollout_ref.actor.optim.clip_grad": {"actor.engine.grad_clip": 0.5},
    "actor_rollout_ref.actor.grad_clip": {"actor.engine.grad_clip": 1.0},  # verl's v1 trainer reads clip_grad
    "trainer.use_v1": {"actor.engine.grad_clip": 0.3},  # the legacy trainer reads grad_clip
    "actor_rollout_ref.actor.optim.lr_warmup_steps": {
        "actor.engine.warmup_steps": 10,
        "actor.engine.warmup_from_zero": True,
        "trainer.lr_schedule_unit": "step",
    },
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": {
        "actor.engine.warmup_steps": 0,
        "actor.engine.warmup_ratio": 0.1,
    },
    "actor_rollout_ref.actor.optim.lr_scheduler_type": {"actor.engine.lr_schedule": "cosine"},
    "actor_rollout_ref.actor.optim.warmup_style": {"actor.engine.lr_schedule": "cosine"},
    "actor_rollout_ref.actor.optim.lr_decay_style": {"actor.engine.lr_schedule": "cosine"},
    "actor_rollout_ref.actor.optim.min_lr": {"actor.engine.min_lr_ratio": 0.1},  # verl's lr 1e-6
    "actor_rollout_ref.actor.ppo_micro_batch_size": {"actor.engine.max_tokens_per_micro_batch": 16 * 1024},
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": {
        "actor.engine.max_tokens_per_micro_batch": 4 * 1024
    },
    "actor_rollout_ref.actor.use_dynamic_bsz": {"actor.engine.max_tokens_per_micro_batch": 16384},
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": {"actor.engine.max_tokens_per_micro_batch": 3000},
    "actor_rollout_ref.actor.policy_loss.loss_mode": {"actor.policy_loss.name": "gspo"},
    "actor_rollout_ref.actor.clip_ratio": {
        "actor.policy_loss.clip_ratio_low": 0.2,
        "actor.policy_loss.clip_ratio_high": 0.2,
    },
    "actor_rollout_ref.actor.clip_ratio_low": {"actor.policy_loss.clip_ratio_low": 0.1},
    "actor_rollout_ref.actor.clip_ratio_high": {"actor.policy_loss.clip_ratio_high": 0.28},
    "actor_rollout_ref.actor.clip_ratio_c": {"actor.policy_loss.clip_ratio_c": 10.0},
    "actor_rollout_ref.actor.loss_agg_mode": {"actor.policy_loss.loss_agg_mode": "seq-mean-token-mean"},
    "actor_rollout_ref.actor.policy_loss.dro_beta": {
        "actor.policy_loss.dro_beta": 0.5,
        "actor.policy_loss.name": "dro",
    },
    "actor_rollout_ref.actor.kl_loss_type": {"algorithm.kl.estimator": "k3+"},
    "actor_rollout_ref.actor.fsdp_config.model_dtype": {"actor.engine.param_dtype": "bfloat16"},
    "actor_rollout_ref.actor.fsdp_config.dtype": {"actor.engine.mixed_precision": "none"},  # fp32 on the CPU
    "actor_rollout_ref.rollout.name": {"rollout.engine.name": "vllm"},
    "actor_rollout_ref.rollout.val_kwargs.temperature": {"rollout.val_temperature": 0.6},
    "actor_rollout_ref.rollout.val_kwargs.top_p": {"rollout.val_top_p": 0.7},
    "actor_rollout_ref.rollout.val_kwargs.top_k": {"rollout.val_top_k": 20},
    "actor_rollout_ref.rollout.val_kwargs.n": {"rollout.val_n": 4},
    "actor_rollout_ref.rollout.val_kwargs.do_sample": {
        "rollout.val_temperature": 0.0
    },  # verl reads the temperature
    "actor_rollout_ref.rollout.gpu_memory_utilization": {},  # the native engine: a note
    "actor_rollout_ref.rollout.enforce_eager": {"rollout.engine.native.cuda_graphs": False},
    "actor_rollout_ref.rollout.enable_prefix_caching": {},
    "actor_rollout_ref.rollout.max_num_seqs": {"rollout.engine.native.max_num_seqs": 128},
    "actor_rollout_ref.rollout.dtype": {"rollout.engine.native.dtype": "bfloat16"},
    "actor_rollout_ref.rollout.logprobs_mode": {},
    "algorithm.kl_penalty": {"algorithm.kl.estimator": "k3"},  # no KL in use: kl_loss_type decides
    "algorithm.filter_groups.max_num_gen_batches": {"algorithm.filter_groups.max_num_gen_batches": 10},
    "algorithm.filter_groups.metric": {
        "algorithm.filter_groups.metric": "acc",
        "algorithm.filter_groups.max_num_gen_batches": 1000,
    },
    "algorithm.rollout_correction.rollout_is": {"algorithm.rollout_correction.is_level": "sequence"},
    "algorithm.rollout_correction.rollout_rs": {
        "algorithm.rollout_correction.rejection": "token",
        "algorithm.rollout_correction.rejection_low": 0.5,
        "algorithm.rollout_correction.rejection_high": 2.0,
    },
    "algorithm.rollout_correction.rollout_rs_threshold": {
        "algorithm.rollout_correction.rejection_low": 1 / 1.5,  # verl: -log(rho) in [log 0.8, log 1.5]
        "algorithm.rollout_correction.rejection_high": 1 / 0.8,
    },
    "custom_reward_function.path": {
        "reward.custom_path": "/work/reward.py",
        "reward.custom_name": "compute_score",
    },
    "custom_reward_function.name": {"reward.custom_name": "score_fn"},
    "reward.custom_reward_function.path": {"reward.custom_path": "/work/reward.py"},
    "reward.custom_reward_function.name": {"reward.custom_name": "score_fn"},
    "reward_model.reward_manager": {},
    "reward.reward_manager.name": {},
    "reward.reward_kwargs.overlong_buffer_cfg.enable": {
        "reward.overlong.enable": True,
        "reward.overlong.buffer": 64,
    },
    "reward.reward_kwargs.overlong_buffer_cfg.len": {"reward.overlong.buffer": 48},
    "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor": {"reward.overlong.penalty_factor": 0.5},
    "reward.reward_kwargs.max_resp_len": {},
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": {
        "reward.overlong.enable": True,
        "reward.overlong.buffer": 64,
    },
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": {"reward.overlong.buffer": 48},
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": {"reward.overlong.penalty_factor": 0.5},
    "reward_model.reward_kwargs.max_resp_len": {},
    "actor_rollout_ref.rollout.multi_turn.enable": {},  # no tools: single-turn episodes, with a note
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": {},  # null; tests/verl/test_moved_and_agent_keys.py
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": {
        "agent.max_turns": 5,
        "agent.name": "tool_agent",
    },
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": {"agent.max_turns": 3},
    "actor_rollout_ref.rollout.multi_turn.format": {"agent.tool_parser": "hermes"},
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": {},
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": {"agent.max_message_chars": 1024},
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": {},
    "actor_rollout_ref.rollout.agent.default_agent_loop": {
        "agent.name": "tool_agent",
        "agent.max_turns": 512,
    },
    "reward_model.overlong_buffer.enable": {"reward.overlong.enable": True, "reward.overlong.buffer": 64},
    "reward_model.overlong_buffer.len": {"reward.overlong.buffer": 48},
    "reward_model.overlong_buffer.penalty_factor": {"reward.overlong.penalty_factor": 0.5},
    "reward.num_workers": {"reward.num_workers": 8},
    "reward_model.num_workers": {"reward.num_workers": 8},
    "reward_model.enable": {"reward.sources": ("model",), "reward.model.path": "/models/rm"},
    "reward_model.model.path": {"reward.sources": ("model",), "reward.model.path": "/models/rm"},
    "reward_model.max_length": {"reward.model.max_length": 1024},
    "reward.reward_model.enable": {"reward.sources": ("model",), "reward.model.path": "/models/rm"},
    "reward.reward_model.model_path": {"reward.sources": ("model",), "reward.model.path": "/models/rm"},
    "critic.model.path": {"critic.model_path": "/models/critic"},
    "critic.model.enable_gradient_checkpointing": {"critic.engine.gradient_checkpointing": False},
    "critic.model.fsdp_config.param_offload": {"critic.offload.params": True},
    "critic.model.fsdp_config.optimizer_offload": {"critic.offload.optimizer": True},
    "critic.optim.lr": {"critic.engine.lr": 2e-5},
    "critic.optim.weight_decay": {"critic.engine.weight_decay": 0.1},
    "critic.optim.betas": {"critic.engine.betas": (0.9, 0.95)},
    "critic.optim.clip_grad": {"critic.engine.grad_clip": 0.5},
    "critic.grad_clip": {"critic.engine.grad_clip": 1.0},
    "critic.optim.lr_warmup_steps": {"critic.engine.warmup_steps": 5},
    "critic.optim.lr_warmup_steps_ratio": {"critic.engine.warmup_ratio": 0.1},
    "critic.optim.lr_scheduler_type": {"critic.engine.lr_schedule": "cosine"},
    "critic.optim.warmup_style": {"critic.engine.lr_schedule": "cosine"},
    "critic.optim.min_lr_ratio": {"critic.engine.min_lr_ratio": 0.1},
    "critic.ppo_mini_batch_size": {"critic.ppo_mini_batch_size": 2},
    "critic.ppo_epochs": {"critic.ppo_epochs": 2},
    "critic.loss_agg_mode": {"critic.loss_agg_mode": "seq-mean-token-mean"},
    "critic.ppo_micro_batch_size_per_gpu": {"critic.engine.max_tokens_per_micro_batch": 3 * 1024},
    "critic.ppo_micro_batch_size": {"critic.engine.max_tokens_per_micro_batch": 3 * 1024},  # 3 over 1 worker
    "critic.use_dynamic_bsz": {"critic.engine.max_tokens_per_micro_batch": 32768},
    "critic.ppo_max_token_len_per_gpu": {"critic.engine.max_tokens_per_micro_batch": 3000},
    "critic.cliprange_value": {"critic.cliprange_value": 0.2},
    "trainer.critic_warmup": {"critic.warmup_steps": 1},  # verl's actor starts at step 2
    "trainer.logger": {"trainer.loggers": ("console", "tensorboard", "jsonl")},
    "trainer.default_local_dir": {"trainer.output_dir": "/ckpt/run"},
    "trainer.resume_mode": {"trainer.resume": "disable"},
    "trainer.resume_from_path": {"trainer.resume": "/ckpt/run/step_10"},
    "trainer.n_gpus_per_node": {"trainer.n_workers": 4, "trainer.device": "cpu"},
    "trainer.nnodes": {"trainer.nnodes": 2, "trainer.backend": "ray"},
    "trainer.device": {"trainer.device": "cpu"},
}

# Joint keys whose example changes nothing here: the note they print.
JOINT_NOTES = {
    "actor_rollout_ref.model.override_config.max_position_embeddings": "a length limit",
    "actor_rollout_ref.actor.grad_clip": "clips by actor_rollout_ref.actor.optim.clip_grad",
    "critic.grad_clip": "clips by critic.optim.clip_grad",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "a vLLM setting",
    "actor_rollout_ref.rollout.enable_prefix_caching": "a vLLM setting",
    "actor_rollout_ref.rollout.val_kwargs.do_sample": "verl samples validation by val_kwargs.temperature",
    "actor_rollout_ref.actor.clip_ratio": "use clip_ratio only where those are null",
    "algorithm.filter_groups.metric": "verl generates until the batch is full",
    "actor_rollout_ref.rollout.multi_turn.enable": "episodes are single-turn",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "drops the rest",
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "keeps the first and last halves",
}


def _args(rule, value) -> list[str]:
    context = CONTEXT.get(rule.key, [])
    overridden = {rule.key, *(item.split("=")[0] for item in context)}
    base = [a for a in BASE if a.split("=")[0] not in overridden]
    if (
        rule.key == "actor_rollout_ref.actor.ppo_micro_batch_size"
        or rule.key.endswith("use_dynamic_bsz")
        or rule.key.endswith("ppo_max_token_len_per_gpu")
    ):
        base = [a for a in base if "ppo_micro_batch_size_per_gpu" not in a]
        if rule.key.endswith("ppo_max_token_len_per_gpu"):
            base.append("actor_rollout_ref.actor.use_dynamic_bsz=true")
    if rule.key == "trainer.nnodes":
        base = [*base, "actor_rollout_ref.rollout.n=4"]
        base = [a for a in base if a != "actor_rollout_ref.rollout.n=2"]
    if rule.key == "trainer.n_gpus_per_node":
        base = [a for a in base if a != "actor_rollout_ref.rollout.n=2"] + ["actor_rollout_ref.rollout.n=4"]
    return [*base, *context, f"{rule.key}={render(value)}"]


def _example(rule):
    return rule.example if rule.example is not MISSING else rule.default


def _settings(translation) -> dict[str, str]:
    return dict(item.split("=", 1) for item in translation.overrides)


@pytest.mark.parametrize("rule", [r for r in RULES if r.kind == "mapped"], ids=lambda r: r.key)
def test_mapped_key(rule):
    value = _example(rule)
    translation = translate(_args(rule, value))
    assert _settings(translation)[rule.to] == render(rule.convert(value))
    translation.config()  # tandem's typed config accepts it


@pytest.mark.parametrize("rule", [r for r in RULES if r.kind == "joint"], ids=lambda r: r.key)
def test_joint_key(rule):
    assert rule.key in JOINT, f"{rule.key} has no translation test"
    translation = translate(_args(rule, _example(rule)))
    settings = _settings(translation)
    for key, value in JOINT[rule.key].items():
        assert settings[key] == render(value), key
    if rule.key in JOINT_NOTES:
        assert any(JOINT_NOTES[rule.key] in note for note in translation.notes), translation.notes
    translation.config()


@pytest.mark.parametrize("rule", [r for r in RULES if r.kind == "noted"], ids=lambda r: r.key)
def test_noted_key(rule):
    value = True if _example(rule) is MISSING else _example(rule)
    translation = translate([*BASE, f"{rule.key}={render(value)}"])
    assert any(note.startswith(rule.key + ":") for note in translation.notes)


@pytest.mark.parametrize("rule", [r for r in RULES if r.kind == "required value"], ids=lambda r: r.key)
def test_required_value_key(rule):
    translate([*BASE, f"{rule.key}={render(rule.only[0])}"])
    other = (
        "something_else"
        if isinstance(rule.only[0], (str, type(None)))
        else (not rule.only[0] if isinstance(rule.only[0], bool) else 7)
    )
    with pytest.raises(ValueError, match=re.escape(rule.key)):
        translate([*BASE, f"{rule.key}={render(other)}"])


def test_docs_list_every_key():
    docs = (Path(__file__).parents[2] / "docs" / "migrating-from-verl.md").read_text()
    assert key_table_markdown() in docs, "regenerate the key table: python -m tandem.verl.key_table"
