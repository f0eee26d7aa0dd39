"""The RL config's rules that join sections live in one module, ``tandem.rl.config.rules``
(issue 52): a section's module checks its own fields only."""

import importlib
import inspect

import pytest

SECTIONS = (  # every module that holds a section of TrainConfig
    "tandem.rl.config.actor",
    "tandem.rl.config.algorithm",
    "tandem.rl.config.data",
    "tandem.rl.config.dataplane",
    "tandem.rl.config.reward",
    "tandem.rl.config.rollout",
    "tandem.rl.config.teacher",
    "tandem.rl.config.trainer",
    "tandem.rl.critic_config",
)


def _functions_of_the_whole_config(module_name: str) -> list[str]:
    """The module-level functions defined in ``module_name`` with a ``TrainConfig`` parameter."""
    module = importlib.import_module(module_name)
    found = []
    for name, function in inspect.getmembers(module, inspect.isfunction):
        if function.__module__ != module_name:
            continue  # imported, not defined here
        annotations = [str(parameter.annotation) for parameter in inspect.signature(function).parameters.values()]
        if any("TrainConfig" in annotation for annotation in annotations):
            found.append(name)
    return found


@pytest.mark.parametrize("module_name", SECTIONS)
def test_no_section_module_holds_a_rule_of_the_whole_config(module_name):
    assert _functions_of_the_whole_config(module_name) == []


def test_the_rules_module_runs_each_of_its_rules():
    """Every ``check_*`` defined in the rules module is called by ``check_train_config``, in the
    order the module's docstring gives (the first broken rule is the one reported)."""
    rules = importlib.import_module("tandem.rl.config.rules")
    defined = [name for name in _functions_of_the_whole_config(rules.__name__) if name != "check_train_config"]
    source = inspect.getsource(rules.check_train_config)
    called = [line.strip().split("(")[0] for line in source.splitlines()[2:] if line.strip()]
    assert called == [
        "check_required_inputs", "check_parallel_layout", "check_group_sizes", "check_batch_shapes",
        "check_head_precision", "check_kl_loss", "check_agent_rewards", "check_pipeline", "check_step_stages",
        "check_router_replay", "check_critic", "check_teacher", "check_dataplane", "check_derived_fields",
    ]  # fmt: skip
    assert sorted(set(defined)) == sorted(set(called) - {"check_dataplane", "check_derived_fields"})
