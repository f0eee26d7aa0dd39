"""Each example plugin of docs/extending.md against the built-in function it re-implements (or, for
the reward and the agent loop, against values worked out by hand and the chat template)."""

import pytest
import torch

from tandem.agents.loops import AgentContext, AgentSample, run_episodes
from tandem.algos import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    AdvantageConfig,
    AdvantageInput,
    KLConfig,
    PolicyLossConfig,
    PolicyLossInput,
    compute_advantage,
    compute_policy_loss,
)
from tandem.algos.preference import PREFERENCE_LOSSES, PreferenceInput, PreferenceLossConfig
from tandem.config.plugins import load_plugins
from tandem.models import load_tokenizer, save_tiny_model
from tandem.protocol.generation import Completion
from tandem.rl.config import RewardConfig
from tandem.rl.rewards import RewardManager
from tandem.rollout import SamplingParams
from tests.plugins.conftest import example


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_the_estimator_plugin_equals_grpo(norm_adv_by_std):
    load_plugins([example("advantage_estimator")])
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(7, 5, generator=generator)
    mask = (torch.rand(7, 5, generator=generator) > 0.3).long()
    inputs = AdvantageInput(rewards * mask, mask, group_ids=torch.tensor([4, 4, 4, 9, 9, 9, 2]))  # 2: alone
    for output in ("advantages", "returns"):
        plugin = compute_advantage(inputs, AdvantageConfig("grpo_loop", norm_adv_by_std=norm_adv_by_std))
        grpo = compute_advantage(inputs, AdvantageConfig("grpo", norm_adv_by_std=norm_adv_by_std))
        torch.testing.assert_close(getattr(plugin, output), getattr(grpo, output), rtol=1e-6, atol=1e-7)
    assert ADVANTAGE_ESTIMATORS.canonical("grpo_loop") == "grpo_loop"


def _policy_inputs(generator):
    log_probs = (torch.randn(4, 6, generator=generator) * 0.3 - 1).requires_grad_()
    old = (
        log_probs.detach() + torch.randn(4, 6, generator=generator) * 0.3
    )  # ratios on both sides of the clip
    advantages = torch.randn(4, 6, generator=generator)
    return log_probs, PolicyLossInput(log_probs, old, advantages, torch.ones(4, 6).tril(2))


def test_the_policy_loss_plugin_equals_ppo_without_the_dual_clip():
    load_plugins([example("policy_loss")])
    results = []
    for name in ("ppo_clip_only", "ppo"):
        log_probs, inputs = _policy_inputs(torch.Generator().manual_seed(1))
        output = compute_policy_loss(
            inputs, PolicyLossConfig(name=name, clip_ratio_c=None, clip_ratio_high=0.28)
        )
        output.loss.backward()
        results.append((output.loss.detach(), log_probs.grad, output.metrics))
    (loss, grad, metrics), (ppo_loss, ppo_grad, ppo_metrics) = results
    torch.testing.assert_close(loss, ppo_loss, rtol=0, atol=0)
    torch.testing.assert_close(grad, ppo_grad, rtol=0, atol=0)
    assert 0 < metrics["pg_clipfrac"] < 1
    for name in ("pg_clipfrac", "ppo_kl"):
        torch.testing.assert_close(metrics[name], ppo_metrics[name], rtol=0, atol=0)


def test_the_kl_plugin_equals_k3_where_k3_s_clamps_do_not_bind():
    load_plugins([example("kl_estimator")])
    generator = torch.Generator().manual_seed(2)
    log_probs, ref = -torch.rand(3, 8, generator=generator) * 3, -torch.rand(3, 8, generator=generator) * 3
    torch.testing.assert_close(
        KL_ESTIMATORS.get("k3_unclamped")(log_probs, ref), KL_ESTIMATORS.get("k3")(log_probs, ref)
    )
    assert KLConfig(estimator="k3_unclamped").estimator == "k3_unclamped"


def test_the_preference_plugin_equals_dpo_s_sigmoid_loss():
    load_plugins([example("preference_loss")])
    generator = torch.Generator().manual_seed(3)
    policy = torch.randn(2, 5, generator=generator).requires_grad_()
    reference = torch.randn(2, 5, generator=generator)
    lengths = torch.full((5,), 4)
    pairs = PreferenceInput(policy[0], policy[1], reference[0], reference[1], lengths, lengths)
    config = PreferenceLossConfig(name="sigmoid", beta=0.3)
    mine = PREFERENCE_LOSSES.get("logistic_margin")(pairs, config)
    dpo = PREFERENCE_LOSSES.get("sigmoid")(pairs, config)
    (grad,) = torch.autograd.grad(mine.loss.sum(), policy)
    (dpo_grad,) = torch.autograd.grad(dpo.loss.sum(), policy)
    for got, expected in [(mine.loss, dpo.loss), (grad, dpo_grad), (mine.chosen_rewards, dpo.chosen_rewards)]:
        torch.testing.assert_close(got, expected)
    torch.testing.assert_close(mine.rejected_rewards, dpo.rejected_rewards)
    assert PreferenceLossConfig(name="logistic_margin").name == "logistic_margin"


def test_the_reward_plugin_scores_its_data_source():
    load_plugins([example("reward_function")])
    result = RewardManager(RewardConfig()).score(
        ["word_overlap"] * 3,
        ["the cat sat", "a cat", "sat the cat"],
        ["The cat sat", "the cat sat", "the cat sat"],
        [{}, {}, {}],
        torch.tensor([3, 2, 3]),
        max_response_length=8,
    )
    assert result.scores.tolist() == pytest.approx([1.0, 1 / 3, 1.0])  # worked out by hand
    assert result.accuracy.tolist() == [1.0, 0.0, 0.0]  # the last one: every word, out of order


class ScriptedModel:
    """A model whose turns are given as text."""

    def __init__(self, tokenizer, turns):
        self.tokenizer, self.turns = tokenizer, list(turns)

    async def generate(self, prompt_ids, params, request_id):
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False) + [
            self.tokenizer.eos_token_id
        ]
        return Completion(request_id, prompt_ids, ids, [-0.5] * len(ids), [3] * len(ids), "stop")


def test_the_agent_loop_plugin_is_two_model_turns_around_a_user_turn(tmp_path):
    load_plugins([example("agent_loop")])
    tokenizer = load_tokenizer(str(save_tiny_model(tmp_path / "model")))
    ctx = AgentContext(
        ScriptedModel(tokenizer, ["41", "42"]), tokenizer, SamplingParams(max_tokens=200), "revise_once"
    )
    (trajectory,) = run_episodes(ctx, [AgentSample([{"role": "user", "content": "6*7=?"}], 0, "e0")])
    revise = "Check your answer. Reply with the final answer only."  # the plugin's REVISE
    conversation = [
        {"role": "user", "content": "6*7=?"},
        {"role": "assistant", "content": "41"},
        {"role": "user", "content": revise},
        {"role": "assistant", "content": "42"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert list(trajectory.context_ids) == rendered[: len(trajectory.context_ids)]  # the template's tokens
    assert trajectory.messages == conversation and trajectory.turns == 2
    first, second = (
        tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in ["41", "42"]
    )
    user_turn = len(trajectory.token_ids) - len(first) - len(second)
    assert trajectory.loss_mask == [1] * len(first) + [0] * user_turn + [1] * len(second)
