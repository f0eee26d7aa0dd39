"""Agent loops inside ``tandem train``: multi-turn episodes become training rows whose
``response_mask`` covers only the model's tokens, the trainer's log-probs match the sampler's
on them, rewards see the whole conversation and the interaction's own reward (as
``extra_info`` and as the ``interaction`` reward source), and the agent metrics are logged."""

import json

import pytest

from tandem.config.overrides import config_from_overrides
from tandem.rl.data.arithmetic import ArithmeticTaskConfig, arithmetic_rows
from tandem.rl.trainer import RLTrainer
from tandem.sft import SFTConfig, SFTTrainer
from tests.rl.conftest import small_config

INTERACTION = """
def respond(messages, extra_info):
    turns = sum(m["role"] == "assistant" for m in messages)
    if turns >= 2:  # ends the episode with a reward of its own: a tenth of the last answer's length
        return {"content": None, "done": True, "reward": len(messages[-1]["content"]) / 10}
    return {"content": "again: " + extra_info["expression"] + "=", "done": False}
"""

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    messages = extra_info["messages"]
    turns = sum(m["role"] == "assistant" for m in messages)
    given = extra_info["interaction_reward"]  # None: the episode ended otherwise (length, max_turns)
    matches = given is None or given == len(messages[-1]["content"]) / 10
    return {"score": float(solution_str.strip() == ground_truth), "turns": float(turns),
            "interaction": given or 0.0, "interaction_matches": float(matches)}
"""


@pytest.fixture(scope="module")
def answering_model(rl_files, tmp_path_factory):
    """The tiny policy after a short SFT on the RL prompts: it answers, then ends its turn."""
    root = tmp_path_factory.mktemp("agent_sft")
    rows = arithmetic_rows(256, ArithmeticTaskConfig(max_digits=2), seed=5)
    conversations = [
        {"messages": [*row["prompt"], {"role": "assistant", "content": row["reward_model"]["ground_truth"]}]}
        for row in rows
    ]
    (root / "sft.jsonl").write_text("".join(json.dumps(c) + "\n" for c in conversations))
    config = config_from_overrides(
        SFTConfig,
        [
            f"model_path={rl_files['model']}", f"data.train_path={root / 'sft.jsonl'}", "engine.lr=3e-3",
            "trainer.total_steps=60", "trainer.global_batch_size=16", f"trainer.output_dir={root / 'sft'}",
        ],
    )  # fmt: skip
    return str(SFTTrainer(config).fit().hf_model_dir)


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_grpo_on_multi_turn_interaction_episodes(answering_model, rl_files, tmp_path, mode):
    """In every pipeline: in the asynchronous ones the episodes run on a rollout replica and reach
    the trainer through the sample queue (validation episodes too)."""
    (tmp_path / "interaction.py").write_text(INTERACTION)
    (tmp_path / "reward.py").write_text(REWARD)
    config = small_config(
        {**rl_files, "model": answering_model}, tmp_path / "run",
        "agent.name=interaction", f"agent.interaction_path={tmp_path / 'interaction.py'}", "agent.max_turns=3",
        f"reward.custom_path={tmp_path / 'reward.py'}", "reward.sources=[rule,interaction]",
        "rollout.max_response_length=40",
        "trainer.total_steps=2", "trainer.val_before_train=false", f"pipeline.mode={mode}",
        "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
    )  # fmt: skip
    result = RLTrainer(config).fit()
    history = result.history
    assert result.validation["val-aux/response_length/mean"] > 2 * 1.5  # two-turn validation episodes
    for entry in history:
        assert entry["agent/turns/mean"] > 1.5  # most episodes have two model turns
        assert entry["reward/extra/turns/mean"] == pytest.approx(
            entry["agent/turns/mean"]
        )  # the reward saw them
        # each row's interaction reward is its own episode's, and the source scores the same values
        assert entry["reward/extra/interaction_matches/mean"] == 1.0
        assert entry["reward/interaction/mean"] == pytest.approx(entry["reward/extra/interaction/mean"])
        assert entry["reward/interaction/mean"] > 0
        if entry.get("pipeline/staleness/max", 0) == 0:  # sampled with the trainer's weights
            assert entry["rollout_corr/max_abs_log_prob_diff"] <= 1e-5  # trainer == sampler on model tokens
        assert sum(v for k, v in entry.items() if k.startswith("agent/finish/")) == pytest.approx(1.0)
        assert entry["response_length/mean"] > entry["agent/turns/mean"] * 2  # the user turns count as length
    if mode != "sync":
        assert history[0]["pipeline/staleness/max"] == 0 and history[1]["pipeline/staleness/max"] <= 1
