"""verl keys that scripts carry from other releases, several data files, and verl's multi-turn
settings mapped onto tandem's agent loops: each compared with the tandem settings written out."""

from __future__ import annotations

import re

import pytest

from tandem.verl import translate
from tests.verl.test_keys import BASE

ROLLOUT = "actor_rollout_ref.rollout"


def _settings(items: list[str]) -> dict[str, str]:
    return dict(item.split("=", 1) for item in translate([*BASE, *items]).overrides)


def test_several_data_files_become_a_list_read_in_order():
    settings = _settings(
        ["data.train_files=['/d/gsm8k.parquet', '/d/math.parquet']", "data.val_files=[/d/gsm8k_test.parquet]"]
    )
    assert settings["data.train_path"] == "[/d/gsm8k.parquet,/d/math.parquet]"
    assert settings["data.val_path"] == "/d/gsm8k_test.parquet"  # a list of one is that file
    config = translate([*BASE, "data.train_files=[/d/gsm8k.parquet,/d/math.parquet]"]).config()
    assert config.data.train_files == ("/d/gsm8k.parquet", "/d/math.parquet")


OVERLONG = {"enable": "true", "len": "48", "penalty_factor": "0.5"}


@pytest.mark.parametrize(
    "place", ["reward.reward_kwargs.overlong_buffer_cfg", "reward_model.reward_kwargs.overlong_buffer_cfg"]
)
@pytest.mark.parametrize("manager", ["reward.reward_manager.name=dapo", "reward_model.reward_manager=dapo"])
def test_the_overlong_buffer_is_read_where_either_release_put_it(place, manager):
    items = [manager, *(f"+{place}.{key}={value}" for key, value in OVERLONG.items())]
    settings = _settings([*items, f"+{place}.log=False", f"+{place.rsplit('.', 1)[0]}.max_resp_len=512"])
    expected = {"reward.overlong.enable": "true", "reward.overlong.buffer": "48"}
    assert {key: settings[key] for key in expected} == expected
    assert settings["reward.overlong.penalty_factor"] == "0.5"


def test_the_same_setting_at_both_places_must_agree():
    both = [
        "reward.reward_manager.name=dapo",
        "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
        "+reward.reward_kwargs.overlong_buffer_cfg.len=48",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.len=64",
    ]
    with pytest.raises(ValueError, match="reward_model.reward_kwargs.overlong_buffer_cfg.len=64"):
        translate([*BASE, *both])
    with pytest.raises(ValueError, match=r"reward_model.reward_kwargs.max_resp_len=100 differs"):
        translate([*BASE, "data.max_response_length=512", "+reward_model.reward_kwargs.max_resp_len=100"])


def test_an_implementation_switch_is_accepted_with_a_note():
    translation = translate([*BASE, "trainer.use_legacy_worker_impl=disable"])
    assert any(note.startswith("trainer.use_legacy_worker_impl:") for note in translation.notes)


def _tool_config(tmp_path, class_name: str, name: str = "code_interpreter", extra: str = "") -> str:
    path = tmp_path / "tools.yaml"
    path.write_text(
        "tools:\n"
        f'  - class_name: "{class_name}"\n'
        "    config:\n"
        "      default_timeout: 30\n"
        "      memory_limit_mb: 2048\n"
        f"{extra}"
        "    tool_schema:\n"
        '      type: "function"\n'
        "      function:\n"
        f'        name: "{name}"\n'
        '        parameters: {type: "object", properties: {code: {type: "string"}}, required: ["code"]}\n'
    )
    return str(path)


SANDBOX = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"


def test_a_verl_code_tool_becomes_tandems_python_tool(tmp_path):
    translation = translate(
        [
            *BASE,
            f"{ROLLOUT}.multi_turn.enable=true",
            f"{ROLLOUT}.multi_turn.tool_config_path={_tool_config(tmp_path, SANDBOX)}",
            f"{ROLLOUT}.multi_turn.max_assistant_turns=5",
            f"{ROLLOUT}.multi_turn.format=hermes",
            f"{ROLLOUT}.agent.num_workers=8",
        ]
    )
    settings = dict(item.split("=", 1) for item in translation.overrides)
    assert {key: value for key, value in settings.items() if key.startswith("agent.")} == {
        "agent.name": "single_turn",  # verl's default loop; rows pick tool_agent by agent_name
        "agent.tools": "[python]",
        "agent.max_turns": "5",
        "agent.tool_parser": "hermes",
        "agent.python.wall_seconds": "30.0",
        "agent.python.cpu_seconds": "30",
        "agent.python.memory_mb": "2048",
        "agent.max_message_chars": "256",  # verl's default cut of a tool response
    }
    notes = "\n".join(translation.notes)
    assert "code_interpreter" in notes and "agent loops are not in tandem" not in notes
    config = translation.config()
    assert list(config.agent.tools) == ["python"] and config.agent.enabled


def test_verl_turn_limits_become_tandems_model_turns(tmp_path):
    tools = f"{ROLLOUT}.multi_turn.tool_config_path={_tool_config(tmp_path, SANDBOX)}"
    # verl ends an episode after the assistant turn that finds user_turns >= max_user_turns
    limited = _settings([tools, f"{ROLLOUT}.multi_turn.max_user_turns=2"])
    assert limited["agent.max_turns"] == "3"
    both = _settings(
        [tools, f"{ROLLOUT}.multi_turn.max_user_turns=4", f"{ROLLOUT}.multi_turn.max_assistant_turns=2"]
    )
    assert both["agent.max_turns"] == "2"
    # no limit in verl: the response budget ends the episode; each model turn takes a token at least
    unlimited = _settings([tools, "data.max_response_length=300"])
    assert unlimited["agent.max_turns"] == "300"
    assert _settings([tools, f"{ROLLOUT}.agent.default_agent_loop=tool_agent"])["agent.name"] == "tool_agent"


@pytest.mark.parametrize(
    ("class_name", "name"),
    [
        ("recipe.retool.retool.CustomSandboxFusionTool", "code_interpreter"),
        ("verl.tools.gsm8k_tool.Gsm8kTool", "calc_gsm8k_reward"),
        ("verl.tools.search_tool.SearchTool", "search"),
    ],
)
def test_a_tool_tandem_cannot_run_is_refused_naming_it(tmp_path, class_name, name):
    path = _tool_config(tmp_path, class_name, name)
    with pytest.raises(ValueError, match=rf"tool '{name}' \({class_name}\)"):
        translate([*BASE, f"{ROLLOUT}.multi_turn.tool_config_path={path}"])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (f"{ROLLOUT}.multi_turn.format=llama3_json", "multi_turn.format=llama3_json"),
        (f"{ROLLOUT}.agent.default_agent_loop=react_agent", "default_agent_loop=react_agent"),
        (f"{ROLLOUT}.multi_turn.interaction_config_path=/x/interaction.yaml", "agent.interaction_path"),
        (f"{ROLLOUT}.multi_turn.tool_config_path=/nowhere/tools.yaml", "/nowhere/tools.yaml"),
    ],
)
def test_multi_turn_settings_tandem_cannot_honour_are_refused(item, message):
    with pytest.raises(ValueError, match=message):
        translate([*BASE, item])


def test_a_sandbox_in_another_language_is_refused(tmp_path):
    path = _tool_config(tmp_path, SANDBOX, extra='      default_language: "cpp"\n')
    with pytest.raises(ValueError, match="default_language='cpp'"):
        translate([*BASE, f"{ROLLOUT}.multi_turn.tool_config_path={path}"])


def test_the_agent_notes_no_longer_say_there_are_no_agent_loops():
    from tandem.verl.keys import RULES

    assert not [rule.key for rule in RULES if "agent loops are not in tandem" in rule.note + rule.why]
    assert not [rule.key for rule in RULES if "no agent loops" in rule.note + rule.why]


@pytest.mark.parametrize(
    "item",
    [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        "actor_rollout_ref.ref.mindspeed.param_offload=True",
        "actor_rollout_ref.actor.veomni.expert_parallel_size=8",
        "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
        "reward.reward_model.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.actor.policy_loss.tau_pos=1.0",
        "actor_rollout_ref.model.lora.merge=True",
    ],
)
def test_engine_and_implementation_keys_of_verl_0_8_and_0_9_are_noted(item):
    key = item.lstrip("+").split("=")[0]
    assert any(note.startswith(f"{key}:") for note in translate([*BASE, item]).notes)


@pytest.mark.parametrize(
    "item",
    [
        "+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.fp8=e4m3",
        "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True",
        "+actor_rollout_ref.rollout.quantization=fp8",
        "actor_rollout_ref.model.mtp.enable=True",
        "+data.apply_chat_template_kwargs.enable_thinking=False",
    ],
)
def test_settings_inside_those_families_that_change_the_math_are_refused(item):
    key = item.lstrip("+").split("=")[0]
    with pytest.raises(ValueError, match=re.escape(key)):
        translate([*BASE, item])


def test_megatron_schedule_and_lora_keys_are_read_at_their_place():
    settings = _settings(
        [
            "actor_rollout_ref.actor.optim.lr=1e-5",
            "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
            "actor_rollout_ref.actor.optim.min_lr=1e-6",
            "actor_rollout_ref.model.lora.rank=8",
        ]
    )
    assert settings["actor.engine.lr_schedule"] == "cosine"
    assert float(settings["actor.engine.min_lr_ratio"]) == pytest.approx(0.1)
    assert (settings["actor.engine.lora.rank"], settings["actor.engine.lora.alpha"]) == ("8", "32.0")


OPTIM = "actor_rollout_ref.actor.optim"


@pytest.mark.parametrize(
    "new, old",
    [
        (f"{OPTIM}.lr_scheduler_type=constant", f"{OPTIM}.warmup_style=cosine"),
        (f"{OPTIM}.lr_scheduler_type=constant", f"{OPTIM}.lr_decay_style=cosine"),
        (f"{OPTIM}.min_lr_ratio=0.5", f"{OPTIM}.min_lr=1e-7"),
        ("actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.rank=16"),
        ("reward.reward_manager.name=dapo", "reward_model.reward_manager=naive"),
        ("reward.num_workers=4", "reward_model.num_workers=8"),
    ],
)
def test_a_moved_setting_given_at_two_places_with_two_values_is_refused(new, old):
    """Each pair is one setting at verl's newer and its older (or Megatron's) place."""
    with pytest.raises(ValueError, match=re.escape(old.split("=")[0])):
        translate([*BASE, new, old])


def test_a_moved_setting_given_at_two_places_with_one_value_is_read():
    settings = _settings(
        [
            f"{OPTIM}.lr_scheduler_type=cosine",
            f"{OPTIM}.warmup_style=cosine",
            f"{OPTIM}.min_lr_ratio=0.1",
            f"{OPTIM}.min_lr=1e-7",
            "actor_rollout_ref.model.lora_rank=8",
            "actor_rollout_ref.model.lora.rank=8",
        ]
    )
    assert settings["actor.engine.lr_schedule"] == "cosine"
    assert float(settings["actor.engine.min_lr_ratio"]) == pytest.approx(0.1)
    assert settings["actor.engine.lora.rank"] == "8"
