"""How a verl command is translated: verl's defaults, names, batch sizes, devices, and the errors."""

from __future__ import annotations

import re

import pytest
import torch

from tandem.verl import translate
from tests.verl.test_keys import BASE


def args(*items):
    """BASE with ``items`` replacing the BASE items of the same key."""
    keys = {item.split("=")[0].lstrip("+") for item in items}
    return [*(item for item in BASE if item.split("=")[0] not in keys), *items]


def config_of(*items):
    return translate(args(*items)).config()


def test_untouched_keys_take_verl_defaults_not_tandem_presets():
    config = config_of()
    assert config.actor.engine.lr == 1e-6 and config.actor.engine.weight_decay == 0.01  # tandem: 1e-6 / 0.0
    assert config.trainer.total_epochs == 30 and config.trainer.val_every == 0  # verl: test_freq=-1
    assert config.algorithm.kl.use_kl_loss is False  # tandem's grpo preset turns it on
    assert config.algorithm.kl.estimator == "k3"  # verl's kl_loss_type=low_var_kl
    assert config.actor.policy_loss.clip_ratio_c == 3.0
    assert config.actor.engine.warmup_from_zero is True
    assert config.data.overlong_prompts == "error"  # filter_overlong_prompts=False, truncation=error
    assert config.rollout.val_temperature == 0.0 and config.rollout.top_k == 0  # verl's top_k=-1
    assert config.trainer.output_dir == "checkpoints/verl_examples/gsm8k"  # verl's default_local_dir
    assert list(config.trainer.loggers) == ["console", "wandb", "jsonl"]


@pytest.mark.parametrize(
    ("verl", "tandem"),
    [
        ("low_var_kl", "k3"),
        ("mse", "k2"),
        ("kl", "k1"),
        ("abs", "abs"),
        ("low_var_kl+", "k3+"),
        ("k2+", "k2"),
    ],
)
def test_kl_type_names(verl, tandem):
    config = config_of(
        "actor_rollout_ref.actor.use_kl_loss=true", f"actor_rollout_ref.actor.kl_loss_type={verl}"
    )
    assert config.algorithm.kl.estimator == tandem


@pytest.mark.parametrize(("verl", "tandem"), [("vanilla", "ppo"), ("geo_mean", "gmpo"), ("gspo", "gspo")])
def test_loss_mode_names(verl, tandem):
    assert config_of(f"actor_rollout_ref.actor.policy_loss.loss_mode={verl}").actor.policy_loss.name == tandem


def test_estimator_aliases():
    assert config_of("algorithm.adv_estimator=grpo_vectorized").algorithm.adv_estimator == "grpo"


def test_kl_penalty_decides_when_only_the_reward_uses_kl():
    config = config_of("algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=mse")
    assert config.algorithm.kl.estimator == "k2" and config.algorithm.kl.use_kl_in_reward


def test_two_different_kl_types_in_use_are_refused():
    with pytest.raises(ValueError, match="kl_loss_type=low_var_kl and algorithm.kl_penalty=kl differ"):
        translate([*BASE, "algorithm.use_kl_in_reward=true", "actor_rollout_ref.actor.use_kl_loss=true"])


def test_micro_batches_become_a_token_budget_per_worker():
    lengths = ["data.max_prompt_length=100", "data.max_response_length=28"]
    assert config_of(*lengths).actor.engine.max_tokens_per_micro_batch == 2 * 128  # BASE: 2 per GPU
    base = [item for item in BASE if "ppo_micro_batch_size_per_gpu" not in item and "n_gpus" not in item]
    global_size = translate(
        [*base, *lengths, "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=8"]
    ).config()
    assert global_size.actor.engine.max_tokens_per_micro_batch == 4 * 128  # 8 over 2 workers
    dynamic = translate([*base, "actor_rollout_ref.actor.use_dynamic_bsz=true"]).config()
    assert dynamic.actor.engine.max_tokens_per_micro_batch == 16384  # verl's ppo_max_token_len_per_gpu
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu=600 is below the longest sequence"):
        translate(
            [
                *base,
                "actor_rollout_ref.actor.use_dynamic_bsz=true",
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600",
            ]
        )


def test_dppo_reads_the_clip_keys_as_divergence_bounds():
    loss = config_of(
        "actor_rollout_ref.actor.policy_loss.loss_mode=dppo_tv",
        "actor_rollout_ref.actor.clip_ratio_low=0.1",
        "actor_rollout_ref.actor.clip_ratio_high=0.3",
    ).actor.policy_loss
    assert (loss.dppo_divergence_low, loss.dppo_divergence_high, loss.dppo_ratio_cap) == (0.1, 0.3, 3.0)


def test_clip_ratio_is_used_only_where_low_and_high_are_null():
    alone = translate([*BASE, "actor_rollout_ref.actor.clip_ratio=0.3"])
    assert alone.config().actor.policy_loss.clip_ratio_low == 0.2  # verl's low/high default to 0.2
    assert any("clip_ratio=0.3" in note for note in alone.notes)
    nulls = config_of(
        "actor_rollout_ref.actor.clip_ratio=0.3",
        "actor_rollout_ref.actor.clip_ratio_low=null",
        "actor_rollout_ref.actor.clip_ratio_high=null",
    )
    assert (nulls.actor.policy_loss.clip_ratio_low, nulls.actor.policy_loss.clip_ratio_high) == (0.3, 0.3)


def test_gpus_become_cpu_workers_only_on_the_cpu():
    cuda = translate(args("trainer.device=cuda"))
    settings = dict(item.split("=", 1) for item in cuda.overrides)
    assert settings["trainer.n_gpus_per_node"] == "1" and "trainer.n_workers" not in settings
    assert settings["actor.engine.mixed_precision"] == "bf16"  # verl's fsdp_config.dtype=bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's own GPUs would decide alone")
def test_several_nodes_keep_their_gpus_when_this_machine_has_none():
    """A Ray head node without GPUs is common: its cluster's nodes hold them."""

    def without_device(*items):
        return [item for item in args(*items) if not item.startswith("trainer.device=")]

    nodes = translate(without_device("trainer.nnodes=2", "actor_rollout_ref.rollout.n=4"))
    settings = dict(item.split("=", 1) for item in nodes.overrides)
    assert (settings["trainer.device"], settings["trainer.n_gpus_per_node"]) == ("cuda", "1")
    assert settings["trainer.backend"] == "ray" and "trainer.n_workers" not in settings
    assert any("the GPUs are the Ray cluster's (this machine sees none)" in note for note in nodes.notes)
    one = dict(item.split("=", 1) for item in translate(without_device()).overrides)  # one node: the CPU
    assert (one["trainer.device"], one["trainer.n_workers"]) == ("cpu", "1")
    cpu = translate(args("trainer.nnodes=2", "actor_rollout_ref.rollout.n=4", "trainer.device=cpu"))
    assert dict(item.split("=", 1) for item in cpu.overrides)["trainer.device"] == "cpu"


def test_hydra_prefixes_and_quoting_are_verl_s():
    config = config_of("+trainer.experiment_name='run one'", "trainer.logger=['console','tensorboard']")
    assert config.trainer.experiment == "run one"
    assert list(config.trainer.loggers) == ["console", "tensorboard", "jsonl"]


def test_unknown_key_names_it_and_the_nearest():
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref.actor.ppo_mini_batch_sise is not a verl key.*ppo_mini_batch_size",
    ):
        translate([*BASE, "actor_rollout_ref.actor.ppo_mini_batch_sise=4"])


def test_unimplemented_feature_names_the_key():
    with pytest.raises(
        ValueError,
        match=r"actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=2: tandem does not implement",
    ):
        translate([*BASE, "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=2"])
    with pytest.raises(
        ValueError, match=r"algorithm.adv_estimator=tir_optimal_token_baseline: tandem does not implement"
    ):
        translate(args("algorithm.adv_estimator=tir_optimal_token_baseline"))
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.name=sglang"):
        translate([*BASE[:2], "actor_rollout_ref.rollout.name=sglang"])


def test_the_last_value_of_a_key_wins_as_in_hydra_and_removal_is_refused():
    assert translate([*BASE, "data.train_batch_size=8"]).config().data.train_batch_size == 8
    with pytest.raises(ValueError, match="~key"):
        translate([*BASE, "~data.val_files"])


def test_tandem_errors_also_name_the_verl_key():
    with pytest.raises(ValueError, match=r"is verl's actor_rollout_ref.actor.ppo_mini_batch_size"):
        translate(args("data.train_batch_size=6")).config()


def test_the_default_estimator_trains_a_critic_with_verl_s_critic_settings():
    items = [item for item in BASE if not item.startswith("algorithm.adv_estimator")]
    config = translate(
        [*items, "critic.model.path=/models/critic", "critic.optim.lr=3e-5", "trainer.critic_warmup=3"]
    ).config()
    assert config.algorithm.adv_estimator == "gae" and config.uses_critic  # verl's default estimator
    critic = config.critic
    assert (critic.model_path, critic.engine.lr, critic.warmup_steps) == ("/models/critic", 3e-5, 2)
    assert (critic.cliprange_value, critic.engine.weight_decay) == (0.5, 0.01)  # verl's defaults
    assert config.critic_mini_batch_prompts == config.mini_batch_prompts  # inherited, as in verl
    with pytest.raises(ValueError, match="also shuffles verl's critic mini-batches"):
        translate([*items, "actor_rollout_ref.actor.shuffle=true"])


def test_learning_rate_steps_once_per_rl_step_like_verl():
    config = config_of("actor_rollout_ref.actor.optim.lr_warmup_steps=3")
    assert config.trainer.lr_schedule_unit == "step" and config.actor.engine.warmup_steps == 3


def test_rejection_needs_a_threshold_and_sweeps_are_refused():
    with pytest.raises(
        ValueError, match="rollout_rs=token_k1 needs algorithm.rollout_correction.rollout_rs_threshold"
    ):
        translate(args("algorithm.rollout_correction.rollout_rs=token_k1"))
    with pytest.raises(ValueError, match="a sweep"):
        translate(args("actor_rollout_ref.rollout.n=2,4"))


def test_dapo_filtering_needs_verl_s_metric_names():
    with pytest.raises(ValueError, match="filter_groups.metric=None"):
        translate(args("algorithm.filter_groups.enable=true"))
    with pytest.raises(ValueError, match="filter_groups.metric=seq_reward"):
        translate(args("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_reward"))
    score = config_of("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score")
    assert (
        score.algorithm.filter_groups.metric == "raw_score"
    )  # verl's score field: before the overlong penalty


STRATEGY_KEYS = [
    "actor_rollout_ref.actor.strategy",
    "actor_rollout_ref.ref.strategy",
    "critic.strategy",
    "actor_rollout_ref.actor.fsdp_config.strategy",
]


@pytest.mark.parametrize("key", STRATEGY_KEYS)
def test_a_training_strategy_verl_does_not_have_is_refused_naming_the_key(key):
    with pytest.raises(ValueError, match=rf"{key}=fsdp_typo: .*fsdp2"):
        translate(args(f"{key}=fsdp_typo"))
    translation = translate(args(f"{key}=fsdp2"))  # one of verl's: tandem's engine stands in for it
    assert any(note.startswith(f"{key}:") for note in translation.notes)


def test_verl_s_other_engines_are_strategies_too():
    translate(args("actor_rollout_ref.actor.strategy=veomni"))  # FSDP underneath: tandem's FSDP2 stands in
    with pytest.raises(ValueError, match="actor_rollout_ref.actor.fsdp_config.strategy=veomni"):
        translate(args("actor_rollout_ref.actor.fsdp_config.strategy=veomni"))  # FSDP's own: fsdp, fsdp2


@pytest.mark.parametrize(
    "item",
    [
        "actor_rollout_ref.actor.strategy=megatron",
        "critic.strategy=megatron",
        "model_engine=megatron",
        "actor_rollout_ref.actor.model_engine=mindspeed",
    ],
)
def test_a_megatron_engine_is_refused_with_the_nearest_setting(item):
    with pytest.raises(
        ValueError, match=rf"{re.escape(item)}: tandem has no Megatron-LM engine.*actor.engine.sp_size"
    ):
        translate(args(item))


PARALLEL_SIZE_KEYS = [
    "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.rollout.data_parallel_size",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
]


@pytest.mark.parametrize("key", PARALLEL_SIZE_KEYS)
@pytest.mark.parametrize("value", ["banana", "0", "-2", "1.5", "true", "null"])
def test_a_parallel_size_that_is_not_a_positive_integer_is_refused_naming_the_key(key, value):
    with pytest.raises(ValueError, match=rf"{key}=.*a positive integer"):
        translate(args(f"{key}={value}"))


@pytest.mark.parametrize(
    "key", [key for key in PARALLEL_SIZE_KEYS if key.startswith("actor_rollout_ref.rollout.")]
)
def test_a_rollout_parallel_size_changes_memory_only_and_is_noted(key):
    translation = translate(args(f"{key}=4"))
    assert any(note.startswith(f"{key}:") for note in translation.notes)


@pytest.mark.parametrize(
    ("key", "what"),
    [
        ("actor_rollout_ref.rollout.pipeline_model_parallel_size", "pipeline parallelism"),
        ("actor_rollout_ref.rollout.expert_parallel_size", "expert parallelism"),
    ],
)
def test_pipeline_and_expert_parallelism_are_refused_above_one(key, what):
    translation = translate(args(f"{key}=1"))
    assert not any("decides it itself" in note for note in translation.notes)
    for value in ("2", "banana"):
        with pytest.raises(ValueError, match=rf"{key}=.*tandem does not implement {what}"):
            translate(args(f"{key}={value}"))


@pytest.mark.parametrize(
    "place",
    [
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    ],
)
def test_ulysses_sizes_become_the_engines_sp_size(place):
    overrides = translate(args(f"{place}=2", "critic.ulysses_sequence_parallel_size=2")).overrides
    assert "actor.engine.sp_size=2" in overrides and "critic.engine.sp_size=2" in overrides
    assert not any(o.startswith("actor.engine.sp_size") for o in translate(args()).overrides)


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
            ],
            "the same verl setting at two of its places",
        ),
        (
            [
                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1",
            ],
            r"actor_rollout_ref.ref.ulysses_sequence_parallel_size=1 with an actor sequence-parallel size of 2",
        ),
    ],
)
def test_ulysses_sizes_that_disagree_are_refused(items, message):
    with pytest.raises(ValueError, match=message):
        translate(args(*items))


def test_verl_s_rollout_routing_replay_is_tandem_s_and_the_rest_is_refused():
    replay = (
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
    )
    assert config_of(*replay).actor.router_replay == "rollout"
    assert config_of().actor.router_replay == "off"
    with pytest.raises(ValueError, match="enable_rollout_routing_replay=True: set it"):
        translate(args("actor_rollout_ref.actor.router_replay.mode=R3"))
    with pytest.raises(ValueError, match="R2 replays the old-log-prob pass's routing"):
        translate(args("actor_rollout_ref.actor.router_replay.mode=R2"))
    # recorded, not replayed: the trainer logs how often its routing differs (vLLM told to record)
    for engine, records in (("vllm", True), ("hf", False)):
        recorded = translate(
            args(
                "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                f"actor_rollout_ref.rollout.name={engine}",
            )
        )
        assert any("moe/routing_disagreement" in note for note in recorded.notes)
        config = recorded.config()
        assert config.actor.router_replay == "off"
        assert config.rollout.engine.vllm.record_routing is records
