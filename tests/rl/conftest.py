"""A helper that builds small RL configs over the ``rl_files`` fixture (tests/conftest.py)."""

import pytest

from tandem.rl import load_train_config


def small_config(files, output_dir, *overrides):
    """A fast GRPO config: 4 prompts x 4 responses, 6 new tokens, rewarding the share of digits."""
    return load_train_config(
        [
            f"model_path={files['model']}",
            f"data.train_path={files['train']}",
            f"data.val_path={files['val']}",
            "data.train_batch_size=4",
            "data.max_prompt_length=64",
            "rollout.n=4",
            "rollout.max_response_length=6",
            "actor.engine.lr=1e-3",
            "trainer.total_steps=2",
            "trainer.loggers=[jsonl]",
            "trainer.export_hf=false",
            f"reward.custom_path={files['reward']}",
            f"trainer.output_dir={output_dir}",
            *overrides,
        ]
    )


def assert_same_histories(
    one: list[dict], two: list[dict], absolute: float = 0.0, relative: float = 1e-5
) -> None:
    """Two runs' step metrics agree (wall-clock times aside) to ``relative`` (1e-5), or ``absolute``;
    ``rollout_corr/*`` and ``critic/advantages/mean`` to 1e-6 absolute, since they measure fp32
    rounding (about 1e-7; a GRPO step's mean advantage is 0 up to it) that splitting sums changes."""
    assert len(one) == len(two)
    for expected, got in zip(one, two, strict=True):
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            wall_clock = name.startswith(("timing_s", "perf/")) or name.endswith(("_s", "_gbps"))
            if wall_clock or not isinstance(value, float):
                continue
            rounding = name.startswith(("rollout_corr/", "critic/advantages/mean"))
            tolerance = max(absolute, 1e-6 if rounding else 0.0)
            assert got[name] == pytest.approx(value, rel=relative, abs=tolerance), (expected["step"], name)
