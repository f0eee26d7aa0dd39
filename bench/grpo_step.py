"""Seconds per GRPO step: tandem's trainer vs TRL's GRPOTrainer on the same model, prompts and settings.

Both: the benchmark's ~3M-parameter Qwen2 (hidden 256, 4 layers), fp32 on CPU, 8 prompts x 8
responses = 64 per step, up to 64 new tokens at temperature 1, no KL term, one optimizer step
per step, the same reward function. TRL runs with ``use_cpu=True, bf16=False,
gradient_checkpointing=False`` and no vLLM (transformers ``generate``). Each side runs
``--warmup`` steps that are not timed, then ``--steps`` timed ones; the median is reported and
the ratio printed. TRL is optional: without it only tandem's numbers are printed.

    python bench/grpo_step.py [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rl import RLTrainer, load_train_config
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows, write_parquet

BENCH_MODEL = TinyModelConfig(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
)
PROMPTS, RESPONSES, NEW_TOKENS, LR = 8, 8, 64, 1e-5
REWARD_SOURCE = (
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
)


def digit_share(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


def time_tandem(root: Path, model: Path, data: Path, steps: int, warmup: int) -> list[float]:
    reward = root / "reward.py"
    reward.write_text(REWARD_SOURCE)
    config = load_train_config(
        [
            "preset=grpo",
            f"model_path={model}",
            f"data.train_path={data}",
            f"data.train_batch_size={PROMPTS}",
            f"rollout.n={RESPONSES}",
            f"rollout.max_response_length={NEW_TOKENS}",
            "algorithm.kl.use_kl_loss=false",
            f"actor.engine.lr={LR}",
            f"reward.custom_path={reward}",
            f"trainer.total_steps={warmup + steps}",
            "trainer.loggers=[]",
            "trainer.report=false",
            "trainer.export_hf=false",
            "trainer.resume=disable",
            f"trainer.output_dir={root / 'tandem'}",
        ]
    )
    history = RLTrainer(config).fit().history
    return [h["timing_s/step"] for h in history[warmup:]]


def time_trl(root: Path, model: Path, data_rows: list[dict], steps: int, warmup: int) -> list[float] | None:
    try:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        return None
    from tandem.models import load_tokenizer

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.started)

    def reward(completions, **kwargs) -> list[float]:
        return [digit_share(c[0]["content"] if isinstance(c, list) else c) for c in completions]

    dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in data_rows])
    args = GRPOConfig(
        output_dir=str(root / "trl"),
        per_device_train_batch_size=PROMPTS * RESPONSES,
        num_generations=RESPONSES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        beta=0.0,
        max_steps=warmup + steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1000,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=load_tokenizer(model),
        callbacks=[timer],
    )
    trainer.train()
    return timer.times[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = save_tiny_model(root / "model", BENCH_MODEL)
        rows = arithmetic_rows(2_000, ArithmeticTaskConfig(max_digits=3), seed=0)
        data = write_parquet(rows, root / "prompts.parquet")
        params = sum(p.numel() for p in __import__("tandem").models.load_model(model).parameters())
        print(
            f"model: {params / 1e6:.2f}M parameters, fp32; {PROMPTS} prompts x {RESPONSES} responses, <= {NEW_TOKENS} new tokens"
        )
        tandem_times = time_tandem(root, model, data, args.steps, args.warmup)
        trl_times = time_trl(root, model, rows, args.steps, args.warmup)
    tandem_median = statistics.median(tandem_times)
    print(
        f"tandem: median {tandem_median:.3f} s/step over {len(tandem_times)} steps ({[round(t, 3) for t in tandem_times]})"
    )
    if trl_times is None:
        print("TRL is not installed (pip install trl): no baseline")
        return
    trl_median = statistics.median(trl_times)
    print(
        f"TRL GRPOTrainer: median {trl_median:.3f} s/step over {len(trl_times)} steps ({[round(t, 3) for t in trl_times]})"
    )
    print(f"speed-up: tandem is {trl_median / tandem_median:.2f}x faster per GRPO step")


if __name__ == "__main__":
    main()
