"""Reused config classes name the key as the user wrote it when a loader builds them (issue 52):
``actor.engine.lr``, not ``engine.lr``; the same class built in Python keeps its own prefix."""

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
from omegaconf import OmegaConf

from tandem.config.build import build_config, key_by_path
from tandem.config.overrides import config_from_overrides, make_writable
from tandem.dpo.config import DPOConfig
from tandem.engine.config import EngineConfig, LoraConfig
from tandem.rl import load_train_config
from tandem.rl.config import TrainConfig
from tandem.rollout.native_config import NativeEngineConfig
from tandem.rollout.vllm_engine import VLLMEngineConfig

BASE = ["model_path=/m", "data.train_path=/d.parquet"]
TOO_LOW = "is outside the allowed range (0.0, inf)"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.engine.lr=-1"], f"actor.engine.lr=-1.0 {TOO_LOW}"),
        (["preset=ppo", "critic.engine.lr=-1"], f"critic.engine.lr=-1.0 {TOO_LOW}"),
        (["teacher.engine.lr=-1"], f"teacher.engine.lr=-1.0 {TOO_LOW}"),
        (["actor.engine.lora.rank=-1"], "actor.engine.lora.rank=-1 is outside the allowed range [0, inf)"),
        (["critic.engine.lora.alpha=0"], f"critic.engine.lora.alpha=0.0 {TOO_LOW}"),
        (
            ["critic.engine.sp_size=2", "critic.engine.use_packing=false"],
            "critic.engine.sp_size=2 needs critic.engine.use_packing=True: sequence parallelism splits packed rows",
        ),  # every key of the message, not only the first
        (
            ["teacher.engine.strategy=zero3"],
            "teacher.engine.strategy='zero3' is not allowed; choose one of ['single', 'ddp', 'fsdp2']",
        ),
        (
            ["rollout.engine.native.dtype=fp8"],
            "rollout.engine.native.dtype='fp8' is not allowed; choose one of ['float32', 'bfloat16', 'float16']",
        ),
        (["rollout.engine.native.max_num_seqs=0"], f"rollout.engine.native.max_num_seqs=0 {TOO_LOW}"),
        (["rollout.engine.vllm.max_num_seqs=0"], f"rollout.engine.vllm.max_num_seqs=0 {TOO_LOW}"),
        (["actor.preference.beta=0"], f"actor.preference.beta=0.0 {TOO_LOW}"),
        (["agent.python.cpu_seconds=0"], f"agent.python.cpu_seconds=0 {TOO_LOW}"),
        (
            ["pipeline.checkpoint_engine.backend=files"],
            "pipeline.checkpoint_engine.directory is required with backend=files (a directory every replica "
            "can read)",
        ),
        (  # a section that already named its full path keeps its message
            ["teacher.engine.lora.rank=4"],
            "teacher.engine.lora.rank: the teacher is frozen; it trains no adapter",
        ),
    ],
)
def test_the_rl_loader_names_a_reused_configs_key_as_written(overrides, message):
    with pytest.raises(ValueError) as error:
        load_train_config([*BASE, *overrides])
    assert str(error.value) == message


def test_a_config_at_its_own_prefix_and_one_built_in_python_keep_todays_messages():
    with pytest.raises(ValueError) as loaded:
        config_from_overrides(
            DPOConfig, ["model_path=/m", "data.train_path=/d.jsonl", "engine.lora.dropout=1.0"]
        )
    with pytest.raises(ValueError) as built:
        LoraConfig(dropout=1.0)
    assert (
        str(loaded.value)
        == str(built.value)
        == "engine.lora.dropout=1.0 is outside the allowed range [0.0, 1.0)"
    )
    for make, message in [
        (lambda: EngineConfig(lr=-1.0), f"engine.lr=-1.0 {TOO_LOW}"),
        (lambda: NativeEngineConfig(max_num_seqs=0), f"rollout.engine.native.max_num_seqs=0 {TOO_LOW}"),
        (lambda: VLLMEngineConfig(max_num_seqs=0), f"vllm.max_num_seqs=0 {TOO_LOW}"),
    ]:
        with pytest.raises(ValueError) as error:
            make()
        assert str(error.value) == message


@pytest.mark.parametrize(
    ("message", "renamed"),
    [
        (
            "engine.tp_size=2 with engine.lora.rank=4: no",
            "actor.engine.tp_size=2 with actor.engine.lora.rank=4: no",
        ),
        ("engine.names[0]='x'", "actor.engine.names[0]='x'"),
        ("engine=3", "actor.engine=3"),
        ("actor.engine.lr and critic.engine.lr", "actor.engine.lr and critic.engine.lr"),  # already whole
        ("the engine. see docs/engine.md, my_engine.lr", "the engine. see docs/engine.md, my_engine.lr"),
    ],
)
def test_key_by_path_renames_only_keys_that_start_with_the_prefix(message, renamed):
    assert key_by_path(message, "engine", "actor.engine") == renamed
    assert key_by_path(message, "engine", "engine") == message


@dataclass(frozen=True)
class Leaf:
    key_prefix: ClassVar[str] = "leaf"
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"leaf.size={self.size} must be positive")


@dataclass(frozen=True)
class Tree:
    left: Leaf = field(default_factory=Leaf)
    leaves: list[Leaf] = field(default_factory=lambda: [Leaf(), Leaf()])
    by_name: dict[str, Leaf] = field(default_factory=lambda: {"a": Leaf()})
    optional: Leaf | None = None
    weights: dict[str, float] = field(default_factory=lambda: {"x": 1.0})
    alias: int = 3
    same: str = "${alias}"  # an interpolation resolves as OmegaConf.to_object resolves it


def merged(schema: type, values: dict):
    """``schema``'s defaults with ``values`` merged in, as a loader merges overrides."""
    node = OmegaConf.structured(schema)
    make_writable(node)  # frozen dataclasses come back read-only
    return OmegaConf.merge(node, values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"left": {"size": 0}}, "left.size=0 must be positive"),
        ({"leaves": [{"size": 1}, {"size": 0}]}, "leaves[1].size=0 must be positive"),
        ({"by_name": {"a": {"size": 0}}}, "by_name.a.size=0 must be positive"),
        ({"optional": {"size": 0}}, "optional.size=0 must be positive"),
    ],
)
def test_errors_inside_lists_and_dicts_of_configs_name_their_item(values, message):
    with pytest.raises(ValueError) as error:
        build_config(merged(Tree, values))
    assert str(error.value) == message


def test_build_config_builds_what_omegaconf_to_object_builds():
    """The reference: OmegaConf's own conversion of the same merged node."""
    tree = merged(Tree, {"optional": {"size": 2}, "alias": 5, "by_name": {"b": {}}})
    assert build_config(tree) == OmegaConf.to_object(tree)
    assert build_config(tree).same == "5"
    train = merged(
        TrainConfig,
        {"model_path": "/m", "data": {"train_path": "/d.parquet"}, "actor": {"engine": {"lr": 3e-4}}},
    )
    assert build_config(train) == OmegaConf.to_object(train)
