"""Configuration: presets compose, overrides are checked against the typed schema, impossible combinations fail early."""

import re
from pathlib import Path

import pytest

from tandem.cli import main
from tandem.rl import load_train_config, presets
from tandem.rl.config import REWARD_SOURCES
from tests.conftest import ROOT

BASE = ["model_path=/m", "data.train_path=/d.parquet"]


def test_every_preset_composes_with_its_algorithm():
    expected = {
        "grpo": ("grpo", "ppo"),
        "dr_grpo": ("grpo", "ppo"),
        "dapo": ("grpo", "ppo"),
        "gspo": ("grpo", "gspo"),
        "cispo": ("grpo", "cispo"),
        "sapo": ("grpo", "sapo"),
        "rloo": ("rloo", "ppo"),
        "reinforce_pp": ("reinforce_plus_plus", "ppo"),
        "remax": ("remax", "ppo"),
        "ppo": ("gae", "ppo"),
    }
    assert sorted(presets()) == sorted([*expected, "online_dpo"])
    for name, (estimator, loss) in expected.items():
        config = load_train_config([*BASE, f"preset={name}"])
        assert (config.algorithm.adv_estimator, config.actor.policy_loss.name) == (estimator, loss)
        assert config.actor.objective == "policy_gradient"
    online = load_train_config([*BASE, "preset=online_dpo"])
    assert (
        online.actor.objective == "preference"
        and online.actor.preference.name == "sigmoid"
        and not online.algorithm.kl.use_kl_loss
    )
    dapo = load_train_config([*BASE, "preset=dapo"])
    assert (
        dapo.actor.policy_loss.clip_ratio_high == 0.28
        and dapo.algorithm.filter_groups.enable
        and dapo.reward.overlong.enable
    )
    assert not load_train_config([*BASE, "preset=dr_grpo"]).algorithm.norm_adv_by_std
    ppo = load_train_config([*BASE, "preset=ppo"])
    assert ppo.uses_critic and ppo.algorithm.kl.use_kl_in_reward and not load_train_config(BASE).uses_critic


def test_overrides_apply_and_bad_ones_name_the_key():
    config = load_train_config(
        [*BASE, "rollout.n=4", "actor.policy_loss.name=gspo", "algorithm.kl.use_kl_loss=false"]
    )
    assert config.rollout.n == 4 and config.actor.policy_loss.name == "gspo"
    with pytest.raises(ValueError, match="rollout.nn"):
        load_train_config([*BASE, "rollout.nn=4"])
    with pytest.raises(ValueError, match="rollout.n=four"):
        load_train_config([*BASE, "rollout.n=four"])
    with pytest.raises(ValueError, match="preset='nope' is not a preset"):
        load_train_config([*BASE, "preset=nope"])
    with pytest.raises(ValueError, match="must look like key=value"):
        load_train_config([*BASE, "rollout.n"])
    for bad, message in [
        (
            "+trainer.bogus=1",
            r"trainer.bogus is not a setting: trainer \(TrainerConfig\) has no field 'bogus'",
        ),
        ("trainer.bogus=1", r"trainer.bogus is not a setting"),
        ("rollout.engine.nativ.dtype=x", r"has no field 'nativ'; did you mean rollout.engine.native\?"),
        (
            "actor.policy_loss=gspo",
            r"actor.policy_loss is a group of settings.*e.g. actor.policy_loss.name=gspo",
        ),
        ("trainer.seed.x=1", r"trainer.seed is a single value, not a group"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_train_config([*BASE, bad])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.ppo_mini_batch_size=5"], "actor.ppo_mini_batch_size=5 must divide data.train_batch_size=32"),
        (["rollout.n=1"], "rollout.n must be at least 2"),
        (
            ["trainer.n_workers=3", "rollout.n=2", "data.train_batch_size=4"],
            "must divide evenly over the 3 workers",
        ),
        (
            ["trainer.n_workers=3", "actor.engine.sp_size=2"],
            r"actor.engine.sp_size=2 must divide the 3 workers \(trainer.nnodes x",
        ),
        (
            ["trainer.n_workers=4", "actor.engine.sp_size=2", "rollout.n=3", "actor.ppo_mini_batch_size=1"],
            r"rollout.n = 3 sequences must divide evenly over the 2 data-parallel ranks",
        ),
        (
            ["preset=ppo", "trainer.n_workers=2", "critic.engine.sp_size=4"],
            "critic.engine.sp_size=4 must divide the 2 workers",
        ),
        (
            ["trainer.n_workers=3", "actor.engine.tp_size=2", "actor.engine.strategy=fsdp2"],
            "actor.engine.tp_size=2 must divide the 3 workers: each data-parallel rank is tp_size workers",
        ),
        (
            ["trainer.n_workers=4", "actor.engine.tp_size=2"],
            "actor.engine.tp_size=2 with actor.engine.strategy=single trains one tensor-parallel group, but the "
            "4 workers form 2: set actor.engine.strategy=fsdp2",
        ),
        (
            [
                "trainer.n_workers=4",
                "actor.engine.tp_size=2",
                "actor.engine.strategy=fsdp2",
                "rollout.n=3",
                "actor.ppo_mini_batch_size=1",
            ],
            r"3 sequences must divide evenly over the 2 data-parallel ranks \(.*, over actor.engine.tp_size\)",
        ),  # fmt: skip
        (
            ["preset=ppo", "trainer.n_workers=2", "critic.engine.tp_size=4"],
            "critic.engine.tp_size=4 must divide the 2 workers",
        ),
        (
            [
                "trainer.n_workers=6",
                "actor.engine.sp_size=2",
                "actor.engine.tp_size=2",
                "actor.engine.strategy=fsdp2",
            ],
            "actor.engine.sp_size=2 x actor.engine.tp_size=2 = 4 must divide the 6 workers",
        ),
        (
            ["trainer.n_workers=3", "actor.engine.ep_size=2"],
            r"actor.engine.ep_size=2 must divide the 3 workers",
        ),
        (
            [
                "trainer.n_workers=4",
                "actor.engine.tp_size=2",
                "actor.engine.strategy=fsdp2",
                "actor.engine.ep_size=4",
            ],
            r"actor.engine.ep_size=4 must divide the 2 data-parallel workers \(the 4 workers over actor.engine.tp_size=2\)",
        ),
        (
            ["preset=ppo", "trainer.n_workers=2", "critic.engine.ep_size=4"],
            "critic.engine.ep_size=4 must divide the 2 workers",
        ),
        (
            [
                "algorithm.distill.objective=reverse_kl",
                "teacher.model_path=/t",
                "teacher.engine.ep_size=4",
                "trainer.n_workers=2",
            ],
            "teacher.engine.ep_size=4 must divide the 2 workers",
        ),
        (
            [
                "algorithm.distill.objective=reverse_kl",
                "teacher.model_path=/t",
                "teacher.engine.tp_size=2",
                "teacher.top_k=4",
                "trainer.n_workers=2",
            ],
            "teacher.top_k=4 with teacher.engine.tp_size=2: the teacher's top-k tokens are not computed",
        ),  # fmt: skip
        (
            [
                "algorithm.distill.objective=jsd",
                "teacher.model_path=/t",
                "teacher.top_k=4",
                "actor.engine.tp_size=2",
                "trainer.n_workers=2",
            ],
            "teacher.top_k=4 with actor.engine.tp_size=2: the student's log-probs of the teacher's top-k tokens",
        ),  # fmt: skip
        (
            ["actor.engine.max_tokens_per_micro_batch=100"],
            "actor.engine.max_tokens_per_micro_batch=100 is below",
        ),
        (["actor.policy_loss.name=nope"], "actor.policy_loss.name='nope' is not registered"),
        (["actor.policy_loss.not_a_knob=1.0"], "actor.policy_loss.not_a_knob"),
        (["rollout.engine.name=sglang"], "rollout.engine.name='sglang' is not allowed"),
        (["trainer.device=tpu"], "trainer.device='tpu' is not allowed"),
        (
            ["actor.engine.seed=5", "trainer.seed=1"],
            r"actor.engine.seed=5 would be overwritten: it follows trainer.seed",
        ),
        (
            ["actor.engine.device=cpu", "trainer.device=cuda"],
            "actor.engine.device='cpu' would be overwritten",
        ),
        (
            ["rollout.engine.vllm.device=cuda:1", "trainer.device=cpu"],
            "rollout.engine.vllm.device='cuda:1' would be overwritten: it follows trainer.device",
        ),
        (["rollout.engine.vllm.device=gpu"], "rollout.engine.vllm.device='gpu' is not allowed"),
        (
            ["rollout.engine.name=vllm", "rollout.free_cache_between_generations=true"],
            "needs rollout.engine.vllm.enable_sleep_mode=true",
        ),
        (
            ["rollout.engine.native.max_model_len=99"],
            r"rollout.engine.native.max_model_len=99 would be overwritten: it follows data.max_prompt_length",
        ),
        (["preset=ppo", "critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size=3 must divide"),
        (["preset=ppo", "critic.engine.seed=4"], "critic.engine.seed=4 would be overwritten"),
        (["critic.engine.lora.rank=4"], "critic.engine.lora.rank"),
        (["rollout.val_n=4"], "rollout.val_n=4 needs rollout.val_temperature > 0"),
        (["trainer.loggers=[console,neptune]"], "trainer.loggers='neptune'"),
        (["model_path="], "model_path is required"),
        (
            ["reward.sources=[rule,interaction]"],
            "reward.sources has 'interaction': set agent.interaction_path",
        ),
        (
            ["actor.engine.logprob_head_dtype=bfloat16"],
            r"log-probs come from a float32 model \(rollout.engine.native.dtype\).*set rollout.engine.native.dtype=bfloat16",
        ),
        (
            ["actor.engine.logprob_head_dtype=bfloat16", "rollout.engine.name=vllm"],
            r"log-probs come from a float32 model \(rollout.engine.vllm.dtype\)",
        ),
    ],
)
def test_impossible_combinations_are_rejected_naming_the_fields(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_train_config([*BASE, *overrides])


def test_engine_fields_follow_the_run_from_one_place():
    from tandem.rl.derived import actor_engine_config, critic_engine_config, rollout_engine_config

    config = load_train_config(
        [*BASE, "trainer.seed=3", "rollout.temperature=0.7", "actor.engine.seed=3", "rollout.engine.name=hf"]
    )
    engine = actor_engine_config(config, "cpu", "single", schedule_steps=12)
    assert (
        engine.model_path,
        engine.seed,
        engine.logprob_temperature,
        engine.device,
        engine.total_steps,
    ) == (
        "/m",
        3,
        0.7,
        "cpu",
        12,
    )
    rollout = rollout_engine_config(config, "cpu")
    assert rollout.name == "hf" and rollout.hf.device == "cpu"
    assert (rollout.native.max_model_len, rollout.native.seed) == (config.max_sequence_length, 3)
    assert rollout.native.prefix_cache_entries == 0  # prompts are shared within a step, not across
    critic = critic_engine_config(config, "cpu", "single", schedule_steps=5)
    assert (critic.head, critic.model_path, critic.seed, critic.total_steps, critic.lr) == (
        "value",
        "/m",
        3,
        5,
        1e-5,
    )
    schedule = load_train_config(
        [*BASE, "data.train_batch_size=8", "actor.ppo_mini_batch_size=2", "actor.ppo_epochs=3"]
    )
    assert schedule.schedule_steps(10, 3, 2) == 10 * 3 * 4  # optimizer steps
    per_step = load_train_config([*BASE, "trainer.lr_schedule_unit=step"])
    assert per_step.schedule_steps(10, 3, 2) == 10  # RL steps, as verl counts them


def test_validation_sampling_uses_its_own_top_p_and_top_k_where_set():
    from tandem.rl.config import RolloutConfig

    rollout = RolloutConfig(top_p=0.9, top_k=50, val_temperature=1.0, val_top_p=0.7)
    assert (rollout.sampling(1.0).top_p, rollout.sampling(1.0).top_k) == (0.9, 50)
    validation = rollout.sampling(1.0, validation=True)
    assert (validation.top_p, validation.top_k) == (0.7, 50)
    greedy = RolloutConfig(val_top_p=0.7).sampling(0.0, validation=True)
    assert (greedy.top_p, greedy.top_k) == (1.0, 0)
    with pytest.raises(ValueError, match="rollout.val_top_p"):
        RolloutConfig(val_top_p=0.0)


def test_verls_algorithm_names_work_in_tandems_own_keys_with_a_note(capsys):
    """``algorithm.kl.estimator=low_var_kl`` is verl's k3: the train command accepts it and says so."""
    config = load_train_config([*BASE, "algorithm.kl.estimator=low_var_kl", "actor.policy_loss.name=vanilla"])
    assert config.algorithm.kl.estimator == "k3" and config.actor.policy_loss.name == "ppo"
    assert main(["train", "--print-config", *BASE, "algorithm.kl.estimator=low_var_kl"]) == 0
    out = capsys.readouterr().out
    assert out.count("note: algorithm.kl.estimator=low_var_kl: tandem calls this KL estimator 'k3'") == 1
    assert "estimator: k3" in out


def test_every_reward_source_is_documented_and_listed_by_tandem_algos(capsys):
    """``REWARD_SOURCES`` is the one list: docs/rl.md describes each, and ``tandem algos`` prints it."""
    docs = (Path(ROOT) / "docs" / "rl.md").read_text()
    section = docs[docs.index("### Reward sources") : docs.index("### Agents and tools")]
    documented = re.findall(r"^- `(\w+)`", section, flags=re.MULTILINE)
    assert documented == list(REWARD_SOURCES)
    assert main(["algos"]) == 0
    assert f"reward sources (reward.sources): {', '.join(REWARD_SOURCES)}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.preference.name=kto", "'kto' is an unpaired loss"),
        ("actor.preference.ld_alpha=0.5", "actor.preference.ld_alpha weighs tokens"),
        ("actor.preference.use_weighting=true", "actor.preference.use_weighting weighs tokens"),
    ],
)
def test_online_dpo_refuses_what_its_pairs_cannot_take(override, message):
    with pytest.raises(ValueError, match=message):
        load_train_config(["preset=online_dpo", *BASE, "rollout.n=4", override])


def test_trainer_ranks_on_several_hosts_are_refused_the_one_host_store_by_name():
    """The data plane is on by default with the ``shm`` engine, whose blocks are one host's files:
    ranks on two hosts are refused at once (not at their first fetch), naming the keys to change."""
    with pytest.raises(ValueError, match=r"trainer.nnodes=2 .* set dataplane.engine=ray .* dataplane.enabled=false"):
        load_train_config([*BASE, "trainer.backend=ray", "trainer.nnodes=2"])
    assert load_train_config([*BASE, "trainer.backend=ray", "trainer.nnodes=2", "dataplane.engine=ray"])
    off = load_train_config([*BASE, "trainer.backend=ray", "trainer.nnodes=2", "dataplane.enabled=false"])
    assert not off.dataplane.enabled
