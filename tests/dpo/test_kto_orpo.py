"""KTO on unpaired rows and ORPO without a reference learn the hedged-sum preference on a tiny
model; bad unpaired rows are named; LD-DPO's reference is desensitised like its policy."""

import json
import math
import shutil

import pytest

from tandem.dpo import KTOTrainer, PreferenceDataConfig, UnpairedDataset, preference_trainer
from tandem.models.loading import load_tokenizer
from tests.dpo.conftest import dpo_config, hedged_pairs, write_jsonl


def unpaired_rows(count, seed):
    """Each hedged pair as two rows: the bare sum desirable, the hedged one not."""
    rows = []
    for pair in hedged_pairs(count, seed):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


@pytest.fixture(scope="module")
def kto_files(dpo_files, tmp_path_factory):
    root = tmp_path_factory.mktemp("kto")
    return {
        **dpo_files,
        "kto_train": write_jsonl(root / "train.jsonl", unpaired_rows(32, seed=2)),
        "kto_val": write_jsonl(root / "val.jsonl", unpaired_rows(8, seed=3)),
    }


def test_kto_learns_to_prefer_desirable_completions(kto_files, tmp_path):
    config = dpo_config(
        kto_files, tmp_path, f"data.train_path={kto_files['kto_train']}", f"data.val_path={kto_files['kto_val']}",
        "preference.name=kto", "preference.beta=0.5", "trainer.total_steps=30", "trainer.eval_every=30",
        "engine.lr=3e-3",
    )  # fmt: skip
    trainer = preference_trainer(config)
    assert isinstance(trainer, KTOTrainer)
    with trainer.started():
        trainer._precompute_reference()
        before = trainer.evaluate_pairs()
    result = trainer.fit()
    first, last = result.history[0], result.history[-1]
    assert first["loss"] == pytest.approx(0.5, abs=0.02)  # σ(0) at the reference, kl 0
    assert {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen"} <= set(first)
    assert last["loss"] < first["loss"] - 0.05 and last["rewards/margins"] > 0.5
    after = result.validation
    assert before["eval_rewards/margins"] == pytest.approx(0.0, abs=1e-4)
    assert after["eval_rewards/margins"] > 0.5  # held-out rows: desirable above undesirable
    assert after["eval_loss"] < before["eval_loss"]
    assert all(math.isfinite(h["kl"]) and h["kl"] >= 0 for h in result.history)


def test_orpo_learns_the_preference_without_a_reference(dpo_files, tmp_path):
    config = dpo_config(
        dpo_files, tmp_path, f"data.train_path={dpo_files['hedged_train']}", f"data.val_path={dpo_files['hedged_val']}",
        "preference.name=orpo", "preference.beta=1.0", "trainer.total_steps=30", "trainer.eval_every=30",
        "engine.lr=3e-3",
    )  # fmt: skip
    trainer = preference_trainer(config)
    with trainer.started():
        before = trainer.evaluate_pairs()
    result = trainer.fit()
    assert not (tmp_path / "reference_logps.pt").exists()  # reference-free: nothing scored
    first, last = result.history[0], result.history[-1]
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(first)
    assert first["loss"] == pytest.approx(first["nll_loss"] - first["log_odds_ratio"], rel=1e-5)
    assert last["loss"] < first["loss"]
    after = result.validation
    assert after["eval_log_odds_chosen"] > before["eval_log_odds_chosen"] + 0.5
    assert (
        after["eval_rewards/accuracies"] >= 0.75
        and after["eval_rewards/accuracies"] > before["eval_rewards/accuracies"]
    )


def test_ld_dpo_and_weighted_losses_start_at_the_reference(dpo_files, tmp_path):
    ld = preference_trainer(
        dpo_config(dpo_files, tmp_path / "ld", "trainer.total_steps=1", "preference.ld_alpha=0.4")
    ).fit()
    assert ld.history[0]["loss"] == pytest.approx(
        math.log(2), abs=1e-5
    )  # reference desensitised the same way
    # reference scores saved under another ld_alpha are not reused: scored again, the loss starts at log 2
    (tmp_path / "ld2").mkdir()
    shutil.copy(tmp_path / "ld" / "reference_logps.pt", tmp_path / "ld2" / "reference_logps.pt")
    again = preference_trainer(
        dpo_config(dpo_files, tmp_path / "ld2", "trainer.total_steps=1", "preference.ld_alpha=0.9")
    ).fit()
    assert again.history[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    mpo = preference_trainer(
        dpo_config(
            dpo_files, tmp_path / "mpo", "trainer.total_steps=1", "preference.names=[sigmoid,bco_pair,sft]",
            "preference.weights=[0.8,0.2,1.0]", "preference.use_weighting=true",
        )
    ).fit()  # fmt: skip
    first = mpo.history[0]
    assert math.isfinite(first["loss"]) and first["nll_loss"] > 0
    assert first["loss"] < 0.8 * math.log(2) + 0.2 * 2 * math.log(2) + first["nll_loss"]  # WPO weights < 1


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"prompt": "1+1=", "completion": "2", "label": "yes"},
            "row 2: label must be true or false, got 'yes'",
        ),
        ({"prompt": "1+1=", "label": True}, "row 2: missing field 'completion'"),
        ({"prompt": "1+1=", "completion": [], "label": False}, "row 2: completion must be a string"),
    ],
)
def test_bad_unpaired_rows_are_named(kto_files, tmp_path, row, message):
    good = unpaired_rows(1, seed=0)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*good, row]))
    tokenizer = load_tokenizer(kto_files["model"])
    with pytest.raises(ValueError, match=f"{path}: {message}".replace("(", r"\(").replace(")", r"\)")):
        UnpairedDataset.load(path, tokenizer, PreferenceDataConfig(train_path=str(path)))
    dropped = UnpairedDataset.load(
        path, tokenizer, PreferenceDataConfig(train_path=str(path), invalid_pairs="drop")
    )
    assert (len(dropped), dropped.invalid) == (2, 1)
    # each row is paired with the previous row's completion for the KL estimate
    assert (
        dropped.pairs[0].rejected == dropped.pairs[1].chosen
        and dropped.pairs[1].rejected == dropped.pairs[0].chosen
    )
