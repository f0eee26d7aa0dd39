"""RL runs that use the example plugins (examples/plugins/), for any backend: a GRPO run with the
policy loss, the KL estimator, the reward function, the step stage (and its estimator) and the agent
loop, and an online-DPO run with the preference loss, the reward function and the agent loop.

The model is the tiny one, except that its generation config ends a turn at any letter or digit:
each model turn is a few characters that end on a stop id, so ``revise_once`` always asks for its
second turn (a turn cut off by the length limit would end the episode). Every row's
``data_source`` is ``word_overlap`` and its ground truth the 62 letters and digits as words, so a
response scores ``k / 62``: ``k`` of its whitespace-separated words are one letter or digit.
"""

from pathlib import Path

from transformers import GenerationConfig

from tandem.data import write_parquet
from tandem.models import load_tokenizer, save_tiny_model
from tandem.models.tokenizer import CHARACTERS
from tandem.rl import RLTrainer
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tests.plugins.conftest import example
from tests.rl.conftest import small_config

WORDS = CHARACTERS[:62]  # 0-9, a-z, A-Z: the ground truth's words, and the model's stop ids

RUNS = {  # run -> (the example plugins it loads, its overrides)
    "grpo": (
        ["policy_loss", "kl_estimator", "reward_function", "step_stage", "agent_loop"],
        [
            "actor.policy_loss.name=ppo_clip_only",
            "algorithm.kl.use_kl_loss=true",
            "algorithm.kl.estimator=k3_unclamped",
            "algorithm.adv_estimator=grpo_token_cost",  # the step stage's estimator: its stage joins
        ],
    ),
    "online_dpo": (
        ["preference_loss", "reward_function", "agent_loop"],
        ["preset=online_dpo", "actor.preference.name=logistic_margin"],
    ),
}


def write_run_files(root: Path) -> dict[str, str]:
    """The stopping tiny model and 64 ``word_overlap`` rows under ``root``, as ``small_config``'s files."""
    model = save_tiny_model(root / "model")
    tokenizer = load_tokenizer(str(model))
    generation = GenerationConfig.from_pretrained(str(model))
    generation.eos_token_id = [tokenizer.eos_token_id, *tokenizer.convert_tokens_to_ids(list(WORDS))]
    generation.save_pretrained(str(model))
    rows = arithmetic_rows(64, ArithmeticTaskConfig(max_digits=2), seed=0)
    for row in rows:
        row["data_source"] = "word_overlap"
        row["reward_model"]["ground_truth"] = " ".join(WORDS)
    return {"model": str(model), "train": str(write_parquet(rows, root / "train.parquet"))}


def plugin_run(files: dict[str, str], output_dir: Path, run: str, *overrides: str) -> list[dict]:
    """The step metrics of two steps of ``run`` (a key of ``RUNS``), 4 prompts x 4 responses, one
    worker in this process unless ``overrides`` say otherwise."""
    plugins, keys = RUNS[run]
    config = small_config(
        {**files, "val": "", "reward": ""},
        output_dir,
        "data.val_path=",
        "reward.custom_path=",  # each row is scored by its data_source's scorer: the plugin's
        f"plugins=[{','.join(example(name) for name in plugins)}]",
        *keys,
        "agent.name=revise_once",
        "rollout.max_response_length=96",  # two model turns and the user turn between them
        *overrides,
    )
    return RLTrainer(config).fit().history
