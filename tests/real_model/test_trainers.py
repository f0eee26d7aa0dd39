"""One step of each trainer on SmolLM2-135M-Instruct, named by its GGUF file, each checked against
a reference: GRPO and PPO on-policy (rollout vs trainer log-probs), SFT against an HF
cross-entropy on the same tokens, DPO against log 2 (the policy is its reference)."""

import json
import math

import pytest
import torch

from tandem.data import write_parquet
from tandem.rl import RLTrainer, load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tests.real_model.conftest import EOS

ON_POLICY_GAP = 1e-4  # rollout vs trainer log-probs, fp32 (tests/real_model/test_rollout.py says why)


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-rl")
    reward = root / "seen.py"
    seen = root / "seen.jsonl"
    reward.write_text(  # scores the share of digits, and records the text each response is scored on
        "import json\n"
        "def compute_score(data_source, solution, ground_truth, extra_info):\n"
        f"    with open({str(seen)!r}, 'a') as f:\n"
        "        f.write(json.dumps(solution) + '\\n')\n"
        "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
    )
    rows = arithmetic_rows(4, ArithmeticTaskConfig(max_digits=1), seed=0)
    return {"train": str(write_parquet(rows, root / "train.parquet")), "reward": str(reward), "seen": seen}


def rl_config(smollm2_gguf, rl_data, output_dir, *overrides):
    """2 prompts x 2 responses of at most 12 tokens, one step, fp32; the policy named by its GGUF file."""
    return load_train_config(
        [
            f"model_path={smollm2_gguf}",
            f"data.train_path={rl_data['train']}",
            "data.train_batch_size=2",
            "data.max_prompt_length=64",
            "rollout.n=2",
            "rollout.max_response_length=12",
            "actor.engine.lr=1e-6",
            "trainer.total_steps=1",
            "trainer.loggers=[jsonl]",
            "trainer.export_hf=false",
            f"reward.custom_path={rl_data['reward']}",
            f"trainer.output_dir={output_dir}",
            *overrides,
        ]
    )


def test_a_grpo_step_is_on_policy_and_rewards_see_text_without_eos(smollm2_gguf, smollm2_dir, rl_data, tmp_path):
    trainer = RLTrainer(rl_config(smollm2_gguf, rl_data, tmp_path))
    assert trainer.config.model_path == smollm2_dir  # resolved once, before any worker started
    (step,) = trainer.fit().history
    assert step["rollout_corr/max_abs_log_prob_diff"] <= ON_POLICY_GAP
    assert abs(step["rollout_corr/kl"]) <= ON_POLICY_GAP
    texts = [json.loads(line) for line in rl_data["seen"].read_text().splitlines()]
    assert len(texts) == 4 and all(EOS not in text for text in texts)


def test_a_ppo_step_with_a_critic_is_on_policy(smollm2_gguf, rl_data, tmp_path):
    config = rl_config(smollm2_gguf, rl_data, tmp_path, "preset=ppo", "critic.engine.lr=1e-4")
    (step,) = RLTrainer(config).fit().history
    assert step["rollout_corr/max_abs_log_prob_diff"] <= ON_POLICY_GAP
    assert abs(step["actor/ppo_kl"]) <= 1e-6  # one update on the batch it sampled: the ratio is 1
    assert math.isfinite(step["critic/vf_loss"]) and step["critic/vf_loss"] > 0


def test_an_sft_step_loss_equals_the_hf_cross_entropy(smollm2_gguf, smollm2_model, smollm2_tokenizer, tmp_path):
    from tandem.engine import EngineConfig
    from tandem.sft import SFTConfig, SFTDataConfig, SFTDataset, SFTTrainer, SFTTrainerConfig

    rows = [
        {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in ((3, 4), (12, 9))
    ]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = SFTDataConfig(train_path=str(train))
    config = SFTConfig(
        model_path=str(smollm2_gguf),
        data=data,
        engine=EngineConfig(lr=1e-6),
        trainer=SFTTrainerConfig(global_batch_size=2, total_steps=1, output_dir=str(tmp_path / "out")),
    )
    result = SFTTrainer(config).fit()
    nll, tokens = 0.0, 0
    for ids, mask in SFTDataset.load(str(train), smollm2_tokenizer, data).samples:
        with torch.no_grad():
            logits = smollm2_model(torch.tensor([ids])).logits[0, :-1].float()
        labels, learned = torch.tensor(ids[1:]), torch.tensor(mask[1:], dtype=torch.bool)
        nll += torch.nn.functional.cross_entropy(logits[learned], labels[learned], reduction="sum").item()
        tokens += int(learned.sum())
    assert result.train_losses[0] == pytest.approx(nll / tokens, rel=1e-5)


def test_a_dpo_step_starts_at_log_2(smollm2_gguf, tmp_path):
    from tandem.config.overrides import config_from_overrides
    from tandem.dpo import DPOConfig, DPOTrainer

    pairs = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "chosen": str(a + b), "rejected": str(a + b + 1)}
        for a, b in ((3, 4), (12, 9))
    ]
    train = tmp_path / "pairs.jsonl"
    train.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    config = config_from_overrides(
        DPOConfig,
        [
            f"model_path={smollm2_gguf}",
            f"data.train_path={train}",
            "trainer.global_batch_size=2",
            "trainer.total_steps=1",
            "engine.lr=1e-6",
            f"trainer.output_dir={tmp_path / 'out'}",
        ],
    )
    (step,) = DPOTrainer(config).fit().history
    assert step["loss"] == pytest.approx(math.log(2), abs=1e-5)  # policy == reference before the update
    assert step["rewards/margins"] == pytest.approx(0.0, abs=1e-4)
