"""Reward sources in the RL trainer: a reward model trained by ``tandem rm`` scores decoded
responses exactly as HF's sequence classifier does, sources combine by weight, and GRPO against
the reward model raises its score on held-out prompts."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tandem.config.overrides import config_from_overrides
from tandem.controller import ResourcePool, create_worker_group
from tandem.models.chat import template_ids
from tandem.models.loading import load_tokenizer
from tandem.protocol import Batch
from tandem.rl.config import RewardConfig, RewardModelSourceConfig
from tandem.rl.rewards.model_worker import RewardModelWorker
from tandem.rl.rewards.sources import RewardSources
from tandem.rl.trainer import RLTrainer
from tandem.rm import RewardModelConfig, RewardModelTrainer
from tests.rl.conftest import small_config


@pytest.fixture(scope="module")
def reward_model(rm_files, tmp_path_factory):
    """A reward model that prefers answers with more digits (held-out ranking about 0.97)."""
    out = tmp_path_factory.mktemp("trained_rm")
    config = config_from_overrides(
        RewardModelConfig,
        [
            f"model_path={rm_files['model']}", f"data.train_path={rm_files['train']}",
            "trainer.global_batch_size=16", "trainer.total_steps=60", "engine.lr=3e-4",
            f"trainer.output_dir={out}",
        ],
    )  # fmt: skip
    return str(RewardModelTrainer(config).fit().hf_model_dir)


def hf_scores(model_dir, prompts, texts):
    """The reference: HF's sequence classifier on the reward model's own chat template."""
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    scores = []
    for messages, text in zip(prompts, texts, strict=True):
        ids = template_ids(tokenizer, [*messages, {"role": "assistant", "content": text}], False)
        with torch.no_grad():
            scores.append(float(model(input_ids=torch.tensor([ids])).logits[0, 0]))
    return torch.tensor(scores)


def test_sources_combine_by_weight_and_the_model_scores_as_hf_does(reward_model, rl_files):
    prompts = [
        [{"role": "user", "content": f"{a}+{b}="}] for a, b in [(1, 2), (30, 4), (7, 7), (12, 40), (5, 0)]
    ]
    texts = ["3", "abc", "14x", "5 2", "zz€"]  # the last: the tiny tokenizer has no "€"
    config = RewardConfig(
        sources=("rule", "model"),
        weights=(2.0, 0.5),
        custom_path=rl_files["reward"],  # the share of digits
        model=RewardModelSourceConfig(path=reward_model, max_length=64),
    )
    sources = RewardSources(config)
    batch = Batch(
        non_tensors={
            "raw_prompt": prompts,
            "data_source": ["arithmetic"] * 5,
            "ground_truth": ["0"] * 5,
            "extra_info": [{}] * 5,
        }
    )
    pool = ResourcePool((2,), name="reward_model")  # two spawned scorers: 5 rows split 3 + 2 (one padded)
    with create_worker_group(RewardModelWorker, pool, "local", args=(config.model, "cpu")) as group:
        group.init_model()
        sources.model_group = group
        result = sources.score(batch, texts, torch.tensor([1, 3, 3, 3, 4]), 8)
    rule = torch.tensor([sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts])
    model = hf_scores(reward_model, prompts[:4], texts[:4])
    model = torch.cat([model, torch.zeros(1)])  # the unencodable one scores 0 and is counted
    torch.testing.assert_close(result.scores, 2.0 * rule + 0.5 * model, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(result.accuracy, rule)
    assert result.metrics["reward/model/errors"] == 1.0 and result.metrics["reward/errors"] == 1.0
    assert result.metrics["reward/rule/mean"] == pytest.approx(float(rule.mean()))
    assert result.metrics["reward/model/mean"] == pytest.approx(float(model.mean()), abs=1e-4)
    assert "cannot encode" in result.errors[0]


def test_the_default_sources_are_exactly_the_rule(rl_files):
    config = RewardConfig(custom_path=rl_files["reward"])
    batch = Batch(non_tensors={"data_source": ["a"] * 2, "ground_truth": ["1"] * 2, "extra_info": [{}] * 2})
    result = RewardSources(config).score(batch, ["12", "ab"], torch.tensor([2, 2]), 8)
    assert result.scores.tolist() == [1.0, 0.0]
    assert not any(name.startswith(("reward/rule", "reward/model")) for name in result.metrics)


def test_grpo_against_the_reward_model_raises_its_score_on_held_out_prompts(reward_model, rl_files, tmp_path):
    config = small_config(
        rl_files, tmp_path / "run", "reward.sources=[model]", f"reward.model.path={reward_model}",
        "reward.custom_path=", "trainer.total_steps=10", "trainer.val_every=10",
    )  # fmt: skip
    result = RLTrainer(config).fit()
    validation = [
        (entry["step"], value)
        for entry in result.history
        for name, value in entry.items()
        if name.startswith("val-aux/arithmetic/score/mean")
    ]
    (first_step, before), (last_step, after) = validation[0], validation[-1]
    assert (first_step, last_step) == (0, 10)
    assert after > before + 2.0, (before, after)  # a similar hand run: -2.5 -> 3.2 (the logit)
    assert all("reward/model/mean" in entry for entry in result.history if entry["step"] > 0)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sources": ("rule", "rule")}, "must name each source once"),
        ({"sources": ("rule", "oracle")}, "reward.sources"),
        ({"sources": ("rule", "model"), "weights": (1.0,)}, "one weight per source"),
        ({"sources": ("model",)}, "reward.model.path"),
        ({"sources": ("judge",)}, "reward.judge.base_url"),
    ],
)
def test_bad_reward_sources_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        RewardConfig(**overrides)
