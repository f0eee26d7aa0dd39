"""The DPO trainer: split-invariant pair loss (packed, padded, any token budget), the reference
at step 1, a run that learns the preference, exact resume, both reference modes, LoRA, the CLI."""

import functools
import math

import pytest
import torch

from tandem.algos.preference import PreferenceLossConfig
from tandem.cli import main
from tandem.dpo import DPOTrainer, PreferenceDataConfig, PreferenceDataset
from tandem.dpo.loss import pair_metrics, preference_loss
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models.loading import load_tokenizer
from tandem.run.trackers import read_jsonl
from tests.dpo.conftest import dpo_config


def _pair_batch(files, pairs=6):
    tokenizer = load_tokenizer(files["model"])
    dataset = PreferenceDataset.load(
        files["train"], tokenizer, PreferenceDataConfig(train_path=files["train"])
    )
    batch = dataset.collate(list(range(pairs)), tokenizer.pad_token_id)
    reference = -torch.rand(len(batch), generator=torch.Generator().manual_seed(0)) * 10
    return batch.assign(tensors={"ref_log_prob": reference})


def _loss_and_grads(files, batch, **engine):
    engine = TorchTrainEngine(EngineConfig(model_path=files["model"], lr=1e-3, **engine))
    engine.initialize()
    config = PreferenceLossConfig(beta=0.5, rpo_alpha=0.3)
    chosen_tokens = float((batch["loss_mask"] * batch["chosen"][:, None]).sum())
    loss_fn = functools.partial(
        preference_loss, config=config, total_pairs=len(batch) // 2, chosen_tokens=chosen_tokens
    )
    result = engine.forward_backward(batch, loss_fn)
    grads = {n: p.grad.clone() for n, p in engine.causal_lm.named_parameters()}
    return result, pair_metrics(result.metrics, chosen_tokens), grads


@pytest.mark.parametrize(
    "engine",
    [
        {"use_packing": True, "max_tokens_per_micro_batch": 40},  # a pair or two per micro-batch
        {"use_packing": True, "share_prompts": False, "max_tokens_per_micro_batch": 120},  # unshared prompts
        {"use_packing": False, "micro_batch_size": 2},  # padded, one pair per micro-batch
        {"use_packing": False, "micro_batch_size": 5},  # padded: whole pairs only (4 rows)
    ],
    ids=["packed-small-budget", "packed-unshared", "padded-2", "padded-5"],
)
def test_pair_loss_and_gradients_do_not_depend_on_how_the_batch_is_split(dpo_files, engine):
    batch = _pair_batch(dpo_files)
    whole, whole_metrics, whole_grads = _loss_and_grads(dpo_files, batch, use_packing=True)
    split, split_metrics, split_grads = _loss_and_grads(dpo_files, batch, **engine)
    assert whole.num_micro_batches == 1 and split.num_micro_batches > 1
    assert split.loss == pytest.approx(whole.loss, rel=1e-5)
    for name, value in whole_metrics.items():
        assert split_metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    for name, grad in whole_grads.items():
        torch.testing.assert_close(split_grads[name], grad, rtol=1e-4, atol=1e-6)


def test_a_pair_longer_than_the_token_budget_is_named_not_split(dpo_files):
    batch = _pair_batch(dpo_files, pairs=2)
    with pytest.raises(ValueError, match=r"sequences \[0, 1\] must share a micro-batch"):
        _loss_and_grads(
            dpo_files, batch, use_packing=True, max_tokens_per_micro_batch=40, share_prompts=False
        )


def _without_timings(history):
    return [{k: v for k, v in h.items() if not k.startswith(("timing_s/", "perf/"))} for h in history]


def test_dpo_starts_at_log_2_and_learns_the_preference(dpo_files, tmp_path):
    config = dpo_config(
        dpo_files, tmp_path, f"data.train_path={dpo_files['hedged_train']}", f"data.val_path={dpo_files['hedged_val']}",
        "trainer.total_steps=40", "trainer.eval_every=20", "engine.lr=3e-3",
    )  # fmt: skip
    result = DPOTrainer(config).fit()
    first, last = result.history[0], result.history[-1]
    assert first["rewards/margins"] == pytest.approx(0.0, abs=0.05)  # one step from the reference
    assert last["loss"] < first["loss"] - 0.1
    assert last["rewards/accuracies"] >= 0.75 and last["rewards/margins"] > 0
    assert result.validation["eval_rewards/accuracies"] > 0.5  # held-out pairs too
    for name in (
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
        "learning_rate",
    ):
        assert all(math.isfinite(h[name]) for h in result.history), name
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(1, 41))
    assert (result.hf_model_dir / "config.json").exists() and result.report.exists()
    assert (tmp_path / "reference_logps.pt").exists()


def test_the_first_step_loss_is_log_2_with_either_reference_and_with_lora(dpo_files, tmp_path):
    losses = {}
    for name, overrides in {
        "precompute": (),
        "model": ("reference=model",),
        "lora": ("reference=model", "engine.lora.rank=4", "engine.lora.alpha=8"),
    }.items():
        result = DPOTrainer(dpo_config(dpo_files, tmp_path / name, "trainer.total_steps=3", *overrides)).fit()
        assert result.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5), name  # policy == reference
        losses[name] = [h["loss"] for h in result.history]
    assert losses["model"] == pytest.approx(losses["precompute"], rel=1e-5)  # the same reference either way


def test_resume_reproduces_the_uninterrupted_run(dpo_files, tmp_path):
    full = DPOTrainer(dpo_config(dpo_files, tmp_path / "full", "trainer.save_every=2")).fit()
    DPOTrainer(dpo_config(dpo_files, tmp_path / "part", "trainer.total_steps=2")).fit()
    resumed = DPOTrainer(dpo_config(dpo_files, tmp_path / "part", "trainer.resume=true")).fit()
    assert [h["step"] for h in resumed.history] == [3, 4]
    assert _without_timings(resumed.history) == _without_timings(full.history[2:])
    assert [r["step"] for r in read_jsonl(tmp_path / "part" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_rpo_adds_the_chosen_nll_and_simpo_needs_no_reference(dpo_files, tmp_path):
    rpo = DPOTrainer(
        dpo_config(dpo_files, tmp_path / "rpo", "trainer.total_steps=1", "preference.rpo_alpha=1.0")
    ).fit()
    first = rpo.history[0]
    assert first["loss"] == pytest.approx(math.log(2) + first["nll_loss"], rel=1e-5)
    simpo = DPOTrainer(
        dpo_config(dpo_files, tmp_path / "simpo", "trainer.total_steps=2", "preference.name=simpo")
    ).fit()
    assert not (tmp_path / "simpo" / "reference_logps.pt").exists()
    assert all(math.isfinite(h["loss"]) for h in simpo.history)


def test_tandem_dpo_command_line(dpo_files, tmp_path, capsys):
    args = [
        "dpo", f"model_path={dpo_files['model']}", f"data.train_path={dpo_files['train']}",
        "trainer.total_steps=2", "trainer.global_batch_size=4", f"trainer.output_dir={tmp_path}",
    ]  # fmt: skip
    assert main(args) == 0
    assert "model written to" in capsys.readouterr().out
    assert main([*args, "preference.beta=-1"]) == 2
    assert "preference.beta" in capsys.readouterr().err
    assert main([*args, "data.invalid_pairs=maybe"]) == 2
    assert "data.invalid_pairs" in capsys.readouterr().err


def test_validation_metrics_do_not_depend_on_the_batch_size(dpo_files, tmp_path):
    values = []
    for size in (16, 5):  # one batch, or four uneven ones
        trainer = DPOTrainer(
            dpo_config(
                dpo_files,
                tmp_path / str(size),
                f"trainer.global_batch_size={size}",
                "preference.rpo_alpha=0.5",
            )
        )
        trainer.reference = {
            "val": -torch.rand(len(trainer.val), 2, generator=torch.Generator().manual_seed(1))
        }
        with trainer.started():
            values.append(trainer.evaluate_pairs())
    assert values[1] == pytest.approx(values[0], rel=1e-5)
    assert set(values[0]) >= {"eval_loss", "eval_rewards/accuracies", "eval_nll_loss", "eval_logps/chosen"}
