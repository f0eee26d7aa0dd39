"""The trainer's idle time and step time with and without ``pipeline.stream_forward``.

The workload of ``bench/async_pipeline.py`` (a tiny Qwen2 fine-tuned to answer with digit strings of
log-normal length, 16 prompts x 4 responses a step, GRPO with a KL loss, so that old log-probs and
the reference forward both run), in an asynchronous mode with ``dataplane.enabled``. Without
streaming the trainer waits for the step's last group, then runs both forwards on the whole draw;
with it, the forwards run on the groups that have finished while the rest are still generating.

Each setting runs ``--rounds`` times, interleaved; the table keeps each one's best round. The
figures are per timed step (after ``--warmup``): ``pipeline/trainer_idle_s`` (the wait for groups,
less the forwards run during it), ``timing_s/gen`` (the whole wait, forwards included), the
forwards' seconds (``timing_s/old_log_prob`` + ``timing_s/ref``) and the step's wall time.

    python bench/stream_forward.py [--steps 12] [--warmup 2] [--rounds 2] [--modes fully_async,one_step_off]
        [--staleness 0] [--chunk-groups 0] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_pipeline import MAX_RESPONSE, build_workload  # noqa: E402
from machine import describe_machine  # noqa: E402

from tandem.rl import RLTrainer, load_train_config  # noqa: E402


class TimedTrainer(RLTrainer):
    """Records when each step ends."""

    def train_step(self):
        metrics = super().train_step()
        self.ends = getattr(self, "ends", []) + [time.perf_counter()]
        return metrics


def run(mode: str, streamed: bool, paths: dict[str, str], root: Path, args) -> dict[str, float]:
    """One run's per-step means over the timed steps."""
    name = f"run-{mode}-{'streamed' if streamed else 'whole'}"
    config = load_train_config(
        [
            "preset=grpo", f"model_path={paths['model']}", f"data.train_path={paths['train']}",
            "data.train_batch_size=16", "data.max_prompt_length=64", "rollout.n=4",
            f"rollout.max_response_length={MAX_RESPONSE}", "actor.engine.lr=1e-5",
            "algorithm.kl.use_kl_loss=true", "trainer.balance_batch=false",
            f"trainer.total_steps={args.steps}", "trainer.loggers=[jsonl]", "trainer.export_hf=false",
            "trainer.report=false", "trainer.save_every=0", f"reward.custom_path={paths['reward']}",
            f"trainer.output_dir={root / name}", "trainer.resume=disable", "dataplane.enabled=true",
            f"pipeline.mode={mode}", "pipeline.trainer_threads=1", "pipeline.rollout_threads=1",
            f"pipeline.staleness_threshold={args.staleness}", "pipeline.partial_rollout=false",
            f"pipeline.stream_forward={str(streamed).lower()}", f"pipeline.stream_forward_groups={args.chunk_groups}",
        ]
    )  # fmt: skip
    trainer = TimedTrainer(config)
    history = trainer.fit().history[-args.steps :][args.warmup :]
    seconds = trainer.ends[-1] - trainer.ends[args.warmup - 1]

    def mean(key: str) -> float:
        return sum(h.get(key, 0.0) for h in history) / len(history)

    return {
        "step_s": seconds / (args.steps - args.warmup),
        "idle_s": mean("pipeline/trainer_idle_s"),
        "gen_s": mean("timing_s/gen"),
        "forward_s": mean("timing_s/old_log_prob") + mean("timing_s/ref"),
        "streamed_rows": mean("pipeline/streamed_rows"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="fully_async,one_step_off")
    parser.add_argument("--staleness", type=int, default=0, help="fully_async: pipeline.staleness_threshold")
    parser.add_argument(
        "--chunk-groups", type=int, default=0, help="pipeline.stream_forward_groups (0: auto)"
    )
    parser.add_argument(
        "--workdir", default="", help="keep the workload here (default: a temporary directory)"
    )
    args = parser.parse_args()
    print(describe_machine())
    root = Path(args.workdir or tempfile.mkdtemp(prefix="tandem-stream-bench-"))
    paths = build_workload(root)
    best: dict[tuple[str, bool], dict[str, float]] = {}
    for round_ in range(args.rounds):
        for mode in args.modes.split(","):
            for streamed in (False, True):
                result = run(mode, streamed, paths, root / f"round{round_}", args)
                print(f"round {round_ + 1} {mode} {'streamed' if streamed else 'whole'}: {result}")
                key = (mode, streamed)
                if key not in best or result["step_s"] < best[key]["step_s"]:
                    best[key] = result
    print(f"\nsettings: staleness_threshold={args.staleness}, stream_forward_groups={args.chunk_groups}")
    print(
        f"{'mode':<14}{'passes':<10}{'step s':>8}{'idle s':>8}{'gen s':>8}{'forward s':>10}{'streamed rows':>15}"
    )
    for (mode, streamed), r in best.items():
        print(
            f"{mode:<14}{'streamed' if streamed else 'whole':<10}{r['step_s']:>8.3f}{r['idle_s']:>8.3f}"
            f"{r['gen_s']:>8.3f}{r['forward_s']:>10.3f}{r['streamed_rows']:>15.1f}"
        )


if __name__ == "__main__":
    main()
