"""``tandem rm``: a Bradley–Terry reward model learns synthetic preferences, ranks held-out
pairs, and exports an HF sequence classifier that scores exactly as the trainer did."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from tandem.cli import main
from tandem.config.overrides import config_from_overrides
from tandem.dpo.data import PreferenceDataset
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.rm import RewardModelConfig, RewardModelTrainer


def rm_config(files, output_dir, *overrides):
    return config_from_overrides(
        RewardModelConfig,
        [
            f"model_path={files['model']}",
            f"data.train_path={files['train']}",
            f"data.val_path={files['val']}",
            "trainer.global_batch_size=16",
            "trainer.total_steps=60",
            "trainer.eval_every=20",
            "engine.lr=3e-4",
            f"trainer.output_dir={output_dir}",
            *overrides,
        ],
    )


def test_a_reward_model_ranks_held_out_pairs_and_exports_a_sequence_classifier(rm_files, tmp_path):
    trainer = RewardModelTrainer(rm_config(rm_files, tmp_path / "rm"))
    with trainer.started():
        before = trainer.evaluate_pairs()["eval_rewards/accuracies"]
    result = RewardModelTrainer(rm_config(rm_files, tmp_path / "rm")).fit()
    after = result.validation["eval_rewards/accuracies"]
    # measured: 0.72 -> 0.97 (a fresh head ranks by chance)
    assert before < 0.8 and after >= 0.9, (before, after)
    assert result.history[-1]["loss"] < result.history[0]["loss"]
    assert not any(name.startswith("logps/") for name in result.history[-1])

    # The export is an HF sequence classifier: its logits rank the held-out pairs as the
    # trainer's validation did, and the engine's reward head reads the same numbers from it.
    model = AutoModelForSequenceClassification.from_pretrained(result.hf_model_dir).eval()
    assert model.config.num_labels == 1 and model.config.pad_token_id is not None
    # the trainer's controller keeps no tokens with dataplane.enabled (the default): tokenise again
    val = PreferenceDataset.load(rm_files["val"], trainer.tokenizer, trainer.config.data)
    batch = val.collate(list(range(len(val))), trainer.tokenizer.pad_token_id)
    with torch.no_grad():
        logits = torch.stack(
            [
                model(input_ids=ids[mask.bool()].unsqueeze(0)).logits[0, 0]
                for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True)
            ]
        )
    assert float((logits[0::2] > logits[1::2]).float().mean()) == pytest.approx(after)
    for packing in (True, False):
        engine = TorchTrainEngine(
            EngineConfig(
                model_path=str(result.hf_model_dir), head="reward", use_packing=packing, micro_batch_size=3
            )
        )
        engine.initialize()
        outputs = engine.forward_backward(batch, None, forward_only=True).outputs
        torch.testing.assert_close(outputs.sequence_summary(batch["loss_mask"]), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("preference.name=sigmoid", "reference-free loss"),
        ("engine.head=lm", "engine.head='lm'"),
        ("preference.rpo_alpha=0.5", "preference.rpo_alpha"),
        ("engine.lora.rank=4", "engine.lora.rank"),
    ],
)
def test_tandem_rm_names_a_bad_setting(rm_files, tmp_path, capsys, override, message):
    args = ["rm", f"model_path={rm_files['model']}", f"data.train_path={rm_files['train']}", override]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_tandem_rm_command_line(rm_files, tmp_path, capsys):
    args = [
        "rm", f"model_path={rm_files['model']}", f"data.train_path={rm_files['train']}",
        "trainer.total_steps=2", "trainer.global_batch_size=4", f"trainer.output_dir={tmp_path}",
    ]  # fmt: skip
    assert main(args) == 0
    assert "model written to" in capsys.readouterr().out
    assert (tmp_path / "hf_model" / "config.json").exists()
