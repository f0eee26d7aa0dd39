"""SFT stops on divergence before saving anything, holds its output directory, and checks it first."""

import pytest

from tandem.engine import EngineConfig
from tandem.errors import DivergenceError, OutputDirInUseError
from tandem.models import save_tiny_model
from tandem.run.output_dir import OutputDirLock
from tandem.sft import SFTConfig, SFTDataConfig, SFTTrainer, SFTTrainerConfig
from tests.sft.test_sft import addition_conversations, write_jsonl


@pytest.fixture(scope="module")
def sft_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_guards")
    return str(save_tiny_model(root / "model")), write_jsonl(
        root / "train.jsonl", addition_conversations(20, 0)
    )


def _config(sft_files, out, lr=1e-3, steps=3):
    model, train = sft_files
    return SFTConfig(
        model_path=model,
        data=SFTDataConfig(train_path=train),
        engine=EngineConfig(lr=lr),
        trainer=SFTTrainerConfig(global_batch_size=4, total_steps=steps, save_every=1, output_dir=str(out)),
    )


def test_lr_1e30_stops_at_step_1_and_saves_nothing(sft_files, tmp_path):
    with pytest.raises(
        DivergenceError, match=r"step 1: .*log-probs are not finite.*No checkpoint was saved yet"
    ):
        SFTTrainer(_config(sft_files, tmp_path, lr=1e30)).fit()
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "hf_model").exists()
    result = SFTTrainer(_config(sft_files, tmp_path, steps=2)).fit()  # the same directory, a sane rate: runs
    assert len(result.train_losses) == 2 and (result.hf_model_dir / "config.json").exists()


def test_a_held_or_blocked_output_dir_is_refused(sft_files, tmp_path):
    trainer = SFTTrainer(_config(sft_files, tmp_path))
    with (
        OutputDirLock(tmp_path, "trainer.output_dir"),
        pytest.raises(OutputDirInUseError, match="trainer.output_dir=.* is in use by another run"),
    ):
        trainer.fit()
    taken = tmp_path / "file"
    taken.write_text("")
    with pytest.raises(ValueError, match=rf"trainer.output_dir={taken}: the file is in the way"):
        SFTTrainer(_config(sft_files, taken))
