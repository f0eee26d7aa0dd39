"""Rollout/trainer mismatch of GRPO on a tiny MoE with a bf16 rollout: router replay off vs on.

The policy is a tiny Qwen3-MoE (4 experts, top-2, hidden 128, 2 layers) with near-tied
routers. ``tests/rollout/test_moe_rollout.py`` scales the router weights by 0.02 for that, but
bf16 rounds relative to a value's size, so scaling every logit alike leaves the chance of a
flipped top-k about where it was (0.16% of the first step's (token, layer) pairs at x1, 0.08%
at x0.02). Here every expert's router row is instead a row shared by all experts plus
``--router-spread`` (0.05) times its own: the logits share a large common part and differ by
small amounts, which bf16's rounding of the large part flips (about 3% at the first step). The
rollout (native engine) runs in bf16, the trainer in fp32. Each setting trains the same prompts
from the same seed for ``--steps`` GRPO steps (8 prompts x 4 responses, <= 16 new tokens, the
share of digits as the reward, no KL term), once with ``actor.router_replay=off`` and once with
``=rollout``; their first rollouts are identical.

Per step and averaged it prints, side by side:

* ``rollout_corr/kl`` (k1, signed) and ``rollout_corr/k3_kl`` (k3, >= 0): the mean KL estimates
  between the rollout's and the trainer's sampled log-probs; ``rollout_corr/max_abs_log_prob_diff``:
  their largest per-token gap;
* ``moe/routing_disagreement``: the share of (token, MoE layer) pairs where the trainer's live
  top-k differs from the rollout's recorded one (each layer's own choice before its replay;
  with replay a layer's input already follows the replayed layers below it).

Not a speed benchmark: these are the numbers replay is meant to move.

    python bench/moe_replay.py [--steps 5] [--router-spread 0.05]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import describe_machine  # noqa: E402

from tandem.data import write_parquet  # noqa: E402
from tandem.models import TinyModelConfig, load_model, save_tiny_model  # noqa: E402
from tandem.rl import RLTrainer, load_train_config  # noqa: E402
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows  # noqa: E402

MODEL = TinyModelConfig(family="qwen3_moe", seed=1)
ROUTER_SPREAD = 0.05  # each expert's own share of its router row: small, so the logits nearly tie
PROMPTS, RESPONSES, NEW_TOKENS = 8, 4, 16
REWARD_SOURCE = (
    "def compute_score(data_source, solution, ground_truth, extra_info):\n"
    "    return sum(c.isdigit() for c in solution) / max(len(solution), 1)\n"
)
COLUMNS = {  # metric -> its short name in the table
    "rollout_corr/kl": "kl",
    "rollout_corr/k3_kl": "k3",
    "rollout_corr/max_abs_log_prob_diff": "max|dlogp|",
    "moe/routing_disagreement": "disagree",
}
SETTINGS = ("off", "rollout")


def prepare(root: Path, router_spread: float) -> Path:
    """Write the near-tied tiny MoE, the prompts and the reward under ``root``; return the model's path."""
    path = save_tiny_model(root / "model", MODEL)
    model = load_model(path)
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            param.data.copy_(param.data[:1] + router_spread * param.data)  # [E, hidden]: row 0 shared
    model.save_pretrained(path)
    write_parquet(arithmetic_rows(256, ArithmeticTaskConfig(max_digits=2), seed=0), root / "prompts.parquet")
    (root / "reward.py").write_text(REWARD_SOURCE)
    return path


def run(root: Path, model: Path, replay: str, steps: int) -> list[dict[str, float]]:
    """Each step's metrics of a GRPO run with ``actor.router_replay=replay``."""
    config = load_train_config(
        [
            "preset=grpo",
            f"model_path={model}",
            f"data.train_path={root / 'prompts.parquet'}",
            f"data.train_batch_size={PROMPTS}",
            f"rollout.n={RESPONSES}",
            f"rollout.max_response_length={NEW_TOKENS}",
            "rollout.engine.native.dtype=bfloat16",
            f"actor.router_replay={replay}",
            "algorithm.kl.use_kl_loss=false",
            "actor.engine.lr=1e-3",
            f"reward.custom_path={root / 'reward.py'}",
            f"trainer.total_steps={steps}",
            "trainer.loggers=[]",
            "trainer.report=false",
            "trainer.export_hf=false",
            "trainer.save_every=0",
            "trainer.resume=disable",
            f"trainer.output_dir={root / ('run-' + replay)}",
        ]
    )
    return [h for h in RLTrainer(config).fit().history if h["step"] > 0]


def table(runs: dict[str, list[dict[str, float]]]) -> str:
    """Per-step rows and a mean row, each metric with one column per setting."""
    header = ["step"] + [f"{short} {replay}" for short in COLUMNS.values() for replay in SETTINGS]
    widths = [max(len(h), 10) for h in header]

    def row(label: str, values: list[float]) -> str:
        cells = [label.ljust(widths[0])] + [
            f"{v:.3g}".rjust(w) for v, w in zip(values, widths[1:], strict=True)
        ]
        return "  ".join(cells)

    lines = [
        "  ".join(
            h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths, strict=True))
        )
    ]
    steps = len(runs[SETTINGS[0]])
    for index in range(steps):
        lines.append(row(str(index + 1), [runs[r][index][m] for m in COLUMNS for r in SETTINGS]))
    lines.append(row("mean", [mean(h[m] for h in runs[r]) for m in COLUMNS for r in SETTINGS]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--router-spread", type=float, default=ROUTER_SPREAD)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = prepare(root, args.router_spread)
        runs = {replay: run(root, model, replay, args.steps) for replay in SETTINGS}
    print(describe_machine())
    print(
        f"model: tiny {MODEL.family} ({MODEL.num_experts} experts, top-{MODEL.num_experts_per_tok}), router rows "
        f"shared + {args.router_spread} x own; rollout bf16 (native), trainer fp32; {PROMPTS} prompts x {RESPONSES} "
        f"responses, <= {NEW_TOKENS} new tokens; router_replay off vs rollout"
    )
    print(table(runs))


if __name__ == "__main__":
    main()
