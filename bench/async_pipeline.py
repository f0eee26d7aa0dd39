"""Trained tokens per second of GRPO on a long-tail workload: sync vs one-step-off vs fully async.

The workload: a tiny Qwen2 (the demo's shape, 256 positions) fine-tuned for a few SFT steps to
answer arithmetic prompts with digit strings whose lengths follow a heavy-tailed (log-normal)
distribution: most responses are short, a few run to ``rollout.max_response_length``. That is
the shape that hurts a synchronous step, which waits for its longest response.

Each mode trains the same prompts for ``--steps`` steps; the first ``--warmup`` are not timed.
Every mode runs ``--rounds`` times, interleaved, and keeps its best round (the machine is shared).
The machine's cores are shared the same way in every mode:

* ``sync``: one process generates, then trains, with ``--threads`` threads (all the cores);
* ``one_step_off`` / ``fully_async``: a rollout process and a trainer process with
  ``--threads / 2`` threads each.

The figure is trained response tokens per second of wall time, as a ratio to sync measured in
the same run. Then :mod:`pipeline_sim` (a discrete-event model) is fed this run's phase times
and projects the three pipelines to 8-128 GPUs.

    python bench/async_pipeline.py [--steps 12] [--warmup 2] [--threads 2] [--rounds 2]
        [--staleness 1] [--old-log-probs recompute|rollout]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402
from pipeline_sim import Workload, project  # noqa: E402

from tandem.data import write_parquet  # noqa: E402
from tandem.engine import EngineConfig  # noqa: E402
from tandem.models import TinyModelConfig, save_tiny_model  # noqa: E402
from tandem.rl import RLTrainer, load_train_config  # noqa: E402
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tandem.sft import SFTConfig, SFTTrainer  # noqa: E402
from tandem.sft.config import SFTTrainerConfig  # noqa: E402
from tandem.sft.data import SFTDataConfig  # noqa: E402

MODEL = TinyModelConfig(
    family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    intermediate_size=384, max_position_embeddings=256,
)  # fmt: skip
TASK = ArithmeticTaskConfig(min_digits=1, max_digits=2, num_operands=2, operators="+")
MAX_RESPONSE = 160
MEDIAN_LENGTH, SIGMA = 14, 1.0  # log-normal response lengths: median 14 tokens, ~2% reach the cap


def long_tail_length(rng: random.Random) -> int:
    return max(1, min(MAX_RESPONSE - 2, int(rng.lognormvariate(math.log(MEDIAN_LENGTH), SIGMA))))


def build_workload(root: Path) -> dict[str, str]:
    """The SFT-shaped model and the RL prompts (cached under ``root``)."""
    model_dir = root / "sft" / "hf_model"
    rows = arithmetic_rows(4_000, TASK, seed=5)
    paths = {
        "train": str(write_parquet(rows, root / "train.parquet")),
        "reward": str(root / "reward.py"),
        "model": str(model_dir),
    }
    Path(paths["reward"]).write_text(
        "def compute_score(data_source, solution, ground_truth, extra_info):\n"
        "    return float(len(solution) % 3 == 0)  # any reward with spread: the cost is what is measured\n"
    )
    if model_dir.exists():
        return paths
    rng = random.Random(0)
    sft_path = root / "sft.jsonl"
    with sft_path.open("w") as file:
        for row in arithmetic_rows(20_000, TASK, seed=6):
            answer = "".join(rng.choice("0123456789") for _ in range(long_tail_length(rng)))
            file.write(
                json.dumps({"messages": [*row["prompt"], {"role": "assistant", "content": answer}]}) + "\n"
            )
    base = save_tiny_model(root / "base", MODEL)
    SFTTrainer(
        SFTConfig(
            model_path=str(base),
            data=SFTDataConfig(train_path=str(sft_path), max_length=256),
            engine=EngineConfig(lr=2e-3),
            trainer=SFTTrainerConfig(
                global_batch_size=64, total_steps=150, log_every=50, output_dir=str(root / "sft")
            ),
        )
    ).fit()
    return paths


class TimedTrainer(RLTrainer):
    """Records when each step ends and how many response tokens it trained."""

    def compute_advantages(self, batch):
        self.tokens = getattr(self, "tokens", []) + [int(batch["response_mask"].sum())]
        return super().compute_advantages(batch)

    def train_step(self):
        metrics = super().train_step()
        self.ends = getattr(self, "ends", []) + [time.perf_counter()]
        return metrics


def run_mode(mode: str, paths: dict[str, str], root: Path, args) -> dict[str, float]:
    threads = args.threads if mode == "sync" else max(1, args.threads // 2)
    config = load_train_config(
        [
            "preset=grpo", f"model_path={paths['model']}", f"data.train_path={paths['train']}",
            "data.train_batch_size=16", "data.max_prompt_length=64", "rollout.n=4",
            f"rollout.max_response_length={MAX_RESPONSE}", "actor.engine.lr=1e-5",
            f"trainer.total_steps={args.steps}", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
            "trainer.report=false", "trainer.save_every=0", f"reward.custom_path={paths['reward']}",
            f"trainer.output_dir={root / ('run-' + mode)}", "trainer.resume=disable",
            f"pipeline.mode={mode}", f"pipeline.trainer_threads={threads}", f"pipeline.rollout_threads={threads}",
            f"pipeline.staleness_threshold={args.staleness}", f"pipeline.old_log_probs={args.old_log_probs}",
        ]
    )  # fmt: skip
    trainer = TimedTrainer(config)
    result = trainer.fit()
    timed = slice(args.warmup, None)
    seconds = trainer.ends[-1] - trainer.ends[args.warmup - 1]
    history = result.history[-args.steps :][timed]

    def mean(name: str) -> float:
        values = [h[name] for h in history if name in h]
        return sum(values) / len(values) if values else 0.0

    return {
        "tokens_per_s": sum(trainer.tokens[timed]) / seconds,
        "step_s": seconds / (args.steps - args.warmup),
        "gen_s": mean("timing_s/gen"),
        "train_s": mean("timing_s/update_actor") + mean("timing_s/old_log_prob"),
        "sync_s": mean("pipeline/weight_sync_s") if mode != "sync" else mean("timing_s/update_weights"),
        "staleness_max": max((h.get("pipeline/staleness/max", 0.0) for h in history), default=0.0),
        "response_mean": mean("response_length/mean"),
        "response_max": max(h["response_length/max"] for h in history),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--staleness", type=int, default=1, help="fully_async: pipeline.staleness_threshold")
    parser.add_argument("--old-log-probs", default="recompute", choices=["recompute", "rollout"])
    parser.add_argument("--modes", default="sync,one_step_off,fully_async")
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="run every mode this many times, interleaved; keep each one's best",
    )
    parser.add_argument(
        "--workdir", default="", help="keep the workload here (default: a temporary directory)"
    )
    args = parser.parse_args()
    print(describe_machine())
    root = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-async-bench-"))
    paths = build_workload(root)
    results: dict[str, dict[str, float]] = {}
    for round_ in range(args.rounds):  # interleaved, so a slow stretch of a shared machine hits every mode
        for mode in args.modes.split(","):
            run = run_mode(mode, paths, root / f"round{round_}", args)
            print(f"round {round_ + 1} {mode}: {run['tokens_per_s']:.0f} trained tokens/s")
            if mode not in results or run["tokens_per_s"] > results[mode]["tokens_per_s"]:
                results[mode] = run
    print(
        f"settings: staleness_threshold={args.staleness}, old_log_probs={args.old_log_probs}, threads={args.threads}"
    )
    base = results["sync"]["tokens_per_s"]
    print(f"\n{'mode':<14}{'tokens/s':>10}{'vs sync':>9}{'step s':>8}{'gen s':>8}{'train s':>9}{'sync s':>8}"
          f"{'stale max':>10}{'resp mean/max':>15}")  # fmt: skip
    for mode, r in results.items():
        print(
            f"{mode:<14}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base:>8.2f}x{r['step_s']:>8.2f}"
            f"{r['gen_s']:>8.2f}{r['train_s']:>9.2f}{r['sync_s']:>8.3f}{r['staleness_max']:>10.0f}"
            f"{r['response_mean']:>9.1f}/{r['response_max']:.0f}"
        )
    sync = results["sync"]
    workload = Workload.from_measured(
        generate_s=sync["gen_s"], train_s=sync["train_s"], sync_s=results["fully_async"]["sync_s"]
    )
    print("\nprojection (bench/pipeline_sim.py), fed with the sync run's phase times:")
    print(project(workload))


if __name__ == "__main__":
    main()
