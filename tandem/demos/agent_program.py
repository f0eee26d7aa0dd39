"""The agent-program demo: GRPO trains a tiny model inside a number-guessing game that a plain
``openai``-client program plays (``tandem/demos/programs/guess.py``, ``agent.name=program``).

The program says "Guess my number from 1 to N.", answers each guess with "Higher: a-b." or
"Lower: a-b." (the numbers still possible) and gives ``max_turns`` guesses; reward 1 if one hits.
Halving the range (binary search) always finds the number in 4 guesses for N <= 15. The SFT
warm-up imitates an *imperfect teacher* that halves the range only ``bisect_rate`` of the games
and otherwise counts up from the low end, which finds only numbers up to ``max_turns``: the
warmed-up greedy model mostly counts. GRPO then rewards only found numbers, through the program's
own return value: games that halve score higher, and the policy learns to halve. The held-out
games (a range and a secret) never appear in any training data.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from transformers.utils import logging as hf_logging

from tandem.data import write_parquet
from tandem.demos.accuracy import accuracy_curve, accuracy_table
from tandem.demos.arithmetic import pipeline_overrides, sft_warm_up
from tandem.demos.programs import guess
from tandem.demos.settings import DemoRunSettings, check_count, check_pipeline, check_share
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl.config_loader import load_train_config
from tandem.rl.trainer import RLResult, RLTrainer

PROGRAM = Path(guess.__file__)
DATA_SOURCE = "guess"
SUCCESS_KEY = f"val-core/{DATA_SOURCE}/acc/mean@1"  # the program's reward is the accuracy: 1 found, 0 not
HIGHS = range(8, 16)  # the games: a secret in 1..N for each of these N (92 games); 4 halvings find any
MODEL = TinyModelConfig(
    family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=384, max_position_embeddings=256,
)  # fmt: skip


@dataclass(frozen=True)
class GuessDemoSettings(DemoRunSettings):
    """Sizes of the agent-program demo (the defaults are what docs/agents.md's numbers were
    measured with): the shared warm-up and RL sizes (:class:`~tandem.demos.settings.DemoRunSettings`;
    ``val_prompts`` is the number of held-out games) and these.

    ``bisect_rate``: share of the teacher's games that halve the range (the others count up);
    ``max_turns``: guesses per game; ``pipeline``: GRPO's ``pipeline.mode`` (measured in ``sync``);
    ``sft_model_dir``: start GRPO from this finished warm-up instead of running step 1.
    """

    sft_steps: int = 200
    sft_batch_size: int = 64
    rl_steps: int = 6
    prompts_per_step: int = 16
    val_prompts: int = 32
    val_every: int = 2
    bisect_rate: float = 0.3
    max_turns: int = 4
    pipeline: str = "sync"
    sft_model_dir: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_share(owner, "bisect_rate", self.bisect_rate)
        check_count(owner, "max_turns", self.max_turns)
        check_pipeline(owner, self.pipeline)
        games = sum(HIGHS)
        if self.val_prompts > games // 2:
            raise ValueError(
                f"{owner}.val_prompts={self.val_prompts} must be at most {games // 2} (half the games)"
            )


def game_row(high: int, secret: int, max_turns: int, index: int) -> dict:
    """One game as an RL row: the prompt, and in ``extra_info`` what the program reads."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"Guess my number from 1 to {high}."}],
        "ability": "game",
        "reward_model": {"style": "rule", "ground_truth": str(secret)},
        "extra_info": {"index": index, "high": high, "secret": secret, "max_turns": max_turns},
    }


def teacher_game(high: int, secret: int, max_turns: int, bisect: bool) -> list[dict]:
    """The teacher's turns in one game, with the program's own answers between them: it halves the
    range (``bisect``) or counts up from its low end."""
    low, turns = 1, []
    for _ in range(max_turns):
        text = str((low + high) // 2 if bisect else low)
        turns.append({"role": "assistant", "content": text})
        feedback, low, high = guess.answer(text, secret, low, high)
        if feedback == "found":
            break
        turns.append({"role": "user", "content": feedback})
    return turns[:-1] if turns[-1]["role"] == "user" else turns  # the game ends on a guess


def write_guess_data(root: Path, settings: GuessDemoSettings) -> dict[str, Path]:
    """The teacher's games, the RL prompts and the held-out games (no game shared)."""
    games = [(high, secret) for high in HIGHS for secret in range(1, high + 1)]
    draw = random.Random(settings.seed)
    held_out = set(draw.sample(games, settings.val_prompts))
    train = [game for game in games if game not in held_out]
    teacher = random.Random(settings.seed + 1)
    path = root / "data" / "guess_sft.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for _ in range(20_000):
            high, secret = teacher.choice(train)
            row = game_row(high, secret, settings.max_turns, 0)
            turns = teacher_game(high, secret, settings.max_turns, teacher.random() < settings.bisect_rate)
            file.write(json.dumps({"messages": [*row["prompt"], *turns]}) + "\n")
    rl_rows = [game_row(*draw.choice(train), settings.max_turns, i) for i in range(5_000)]
    val_rows = [
        game_row(high, secret, settings.max_turns, i) for i, (high, secret) in enumerate(sorted(held_out))
    ]
    return {
        "sft": path,
        "train": write_parquet(rl_rows, root / "data" / "guess_train.parquet"),
        "val": write_parquet(val_rows, root / "data" / "guess_val.parquet"),
    }


def rl_overrides(
    settings: GuessDemoSettings, sft_model: str, paths: dict[str, Path], root: Path
) -> list[str]:
    """The RL run's settings: GRPO from the warmed-up model, each episode one game of the program,
    its return value the only reward, validation every ``val_every`` steps, and the pipeline."""
    return [
        "preset=grpo",
        f"model_path={sft_model}",
        f"data.train_path={paths['train']}",
        f"data.val_path={paths['val']}",
        f"data.train_batch_size={settings.prompts_per_step}",
        "data.max_prompt_length=48",
        f"rollout.n={settings.responses_per_prompt}",
        "rollout.max_response_length=160",  # 4 guesses and 3 answers take about 115 tokens
        f"actor.engine.lr={settings.rl_lr}",
        f"actor.ppo_mini_batch_size={settings.prompts_per_step}",
        "agent.name=program",
        f"agent.program={PROGRAM}",
        "reward.sources=[interaction]",
        f"trainer.total_steps={settings.rl_steps}",
        f"trainer.val_every={settings.val_every}",
        f"trainer.output_dir={root / 'agent_program'}",
        "trainer.resume=disable",
        f"trainer.seed={settings.seed}",
        "trainer.experiment=demo-agent-program-guessing",
        *pipeline_overrides(settings.pipeline),
        # asynchronous: the ratio against the policy that sampled, as in the tool demo
        *(["pipeline.old_log_probs=rollout"] if settings.pipeline != "sync" else []),
    ]


def warm_up(settings: GuessDemoSettings, base: Path, data: Path, root: Path, console: Console) -> Path:
    """Step 1: SFT on the imperfect teacher's games; returns the fine-tuned model directory."""
    console.rule(
        f"1. SFT warm-up ({settings.sft_steps} steps) on a teacher that halves the range in "
        f"{settings.bisect_rate:.0%} of its games and counts up otherwise"
    )
    return sft_warm_up(settings, base, data, 192, root / "guess_sft", 50, console)


def run_guess_demo(settings: GuessDemoSettings | None = None, console: Console | None = None) -> RLResult:
    """Build, warm up on the imperfect teacher, train with GRPO through the agent program, and
    print held-out success before and after."""
    settings = settings or GuessDemoSettings()
    console = console or Console()
    hf_logging.disable_progress_bar()
    root = Path(settings.output_dir)
    started = time.monotonic()
    console.rule("tandem demo: a number-guessing game played by an openai-client agent program")
    base = save_tiny_model(root / "guess_base_model", MODEL)
    paths = write_guess_data(root, settings)
    sft_model = settings.sft_model_dir or str(warm_up(settings, base, paths["sft"], root, console))
    console.rule(
        f"2. GRPO through the agent program {PROGRAM.name} ({settings.rl_steps} steps of "
        f"{settings.prompts_per_step} prompts x {settings.responses_per_prompt} games)"
    )
    result = RLTrainer(load_train_config(rl_overrides(settings, sft_model, paths, root)), console).fit()
    guesses = [r["agent/turns/mean"] for r in result.history if "agent/turns/mean" in r]
    title = (
        f"held-out greedy success ({settings.val_prompts} unseen games, {settings.max_turns} guesses each)"
    )
    console.print(accuracy_table(title, "GRPO", accuracy_curve(result, SUCCESS_KEY)))
    console.print(
        f"guesses per sampled game: {guesses[0]:.2f} at step 1, {guesses[-1]:.2f} at step {len(guesses)}; "
        f"total time {time.monotonic() - started:.0f} s; report: {result.report}"
    )
    return result
