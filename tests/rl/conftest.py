"""A helper that builds small RL configs over the ``rl_files`` fixture (tests/conftest.py)."""

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
