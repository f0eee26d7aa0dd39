"""GRPO on a vision-language model: the rollout's log-probs of image prompts are the trainer's,
in the colocated and the fully asynchronous pipelines, and validation keeps the pictures."""

from __future__ import annotations

import math

import pytest

from tandem.data import write_parquet
from tandem.models.tiny_vlm import save_tiny_vlm
from tandem.rl import RLTrainer, load_train_config
from tandem.rl.data.shapes import shapes_rows
from tandem.run.trackers import read_jsonl


@pytest.fixture(scope="module")
def vlm_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm_rl")
    return {
        "model": str(save_tiny_vlm(root / "model")),
        "train": str(write_parquet(shapes_rows(32, seed=0), root / "train.parquet")),
        "val": str(write_parquet(shapes_rows(8, seed=1, split="test"), root / "val.parquet")),
    }


def vlm_config(files, output_dir, *overrides):
    return load_train_config(
        [
            f"model_path={files['model']}",
            f"data.train_path={files['train']}",
            f"data.val_path={files['val']}",
            "data.train_batch_size=4",
            "data.max_prompt_length=128",
            "rollout.n=4",
            "rollout.max_response_length=5",
            "actor.engine.lr=1e-3",
            "trainer.total_steps=2",
            "trainer.loggers=[jsonl]",
            "trainer.export_hf=false",
            f"trainer.output_dir={output_dir}",
            *overrides,
        ]
    )


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_grpo_on_image_prompts_agrees_with_its_rollout(vlm_files, tmp_path, mode):
    overrides = [f"pipeline.mode={mode}"]
    if mode != "sync":
        overrides += ["pipeline.trainer_threads=1", "pipeline.rollout_threads=1"]
    result = RLTrainer(vlm_config(vlm_files, tmp_path, *overrides)).fit()
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == [1, 2]
    for metrics in steps:
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
        # the trainer recomputes each sampled token's log-prob with the same images: they agree
        assert metrics["rollout_corr/max_abs_log_prob_diff"] < 1e-4
    assert "val-core/shapes/acc/mean@1" in result.validation
    samples = read_jsonl(tmp_path / "val_samples.jsonl")
    assert samples and all(
        len(s["images"]) == 1 and s["images"][0].startswith("data:image/png") for s in samples
    )
