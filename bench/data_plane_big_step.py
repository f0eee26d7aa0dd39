"""One SFT step whose batch is >= 2 GB on today's path, run with the data plane on, the
controller's peak RSS printed beside today's (``python bench/data_plane.py --big-step``).

The step is a real :class:`~tandem.sft.SFTTrainer` step over ``--workers`` spawned ranks (a
2-layer, hidden-64 model, the character tokenizer): ``--step-rows`` conversations in one global
batch, their lengths long-tailed (most a few dozen tokens, one of ``--step-width``), so today's
padded batch — ``input_ids``, ``attention_mask``, ``loss_mask``, int64 ``[rows, width]`` — holds
``24 x rows x width`` bytes while the ranks' packed micro-batches compute only the real tokens.
With ``dataplane.enabled`` the controller sends row numbers and each rank collates its rows from
the data file (:mod:`tandem.sft.dataset_rows`).

Each path runs in a fresh process (its ``VmHWM`` is the controller's alone; the ranks are other
processes): the peak over the whole run (loading the data included) and over the step (reset
just before it). Today's path runs at ``1 / --today-scale`` of the rows (the same width: one
row of ``--step-width`` is among them), and its step's peak above the floor is scaled up to the full
size: at the full size its controller would hold the 2 GB batch plus its copies to the ranks,
more than a shared machine spares.

    python bench/data_plane.py --big-step [--step-rows 22000] [--step-width 4096] [--workers 2] [--today-scale 8]
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_plane import peak_rss_mb, reset_peak_rss

from tandem.config.overrides import config_from_overrides
from tandem.data.rows import write_rows
from tandem.dataplane import traffic
from tandem.models import save_tiny_model
from tandem.models.tiny import TinyModelConfig
from tandem.protocol.traffic import batch_traffic
from tandem.sft import SFTConfig, SFTTrainer

SLOT_BYTES = 3 * 8  # input_ids, attention_mask, loss_mask: int64 each
TEMPLATE_TOKENS = 40  # what the chat template adds around the two messages, at most (char tokenizer)


def conversations(rows: int, width: int, seed: int = 0) -> list[dict]:
    """``rows`` conversations: the first ``width`` tokens long (cut there), the rest long-tailed short."""
    rng = random.Random(seed)
    out = []
    for row in range(rows):
        answer = width if row == 0 else min(int(rng.paretovariate(1.5) * 12), width // 2)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"echo {row}"},
                    {"role": "assistant", "content": "".join(rng.choice("abcdefgh ") for _ in range(answer))},
                ]
            }
        )
    return out


class MeasuredSFT(SFTTrainer):
    """The SFT trainer, recording the controller's peak RSS and traffic around its step."""

    def train_step(self):
        reset_peak_rss()
        floor = peak_rss_mb()
        before, moved = batch_traffic(), traffic()
        started = time.perf_counter()
        metrics = super().train_step()
        self.measured = {
            "step_s": time.perf_counter() - started,
            "step_floor_mb": floor,
            "step_peak_mb": peak_rss_mb(),
            "controller_batch_bytes": (batch_traffic() - before).total,
            "controller_put_bytes": (traffic() - moved).put_bytes,
            "loss": metrics["loss"],
        }
        return metrics


def run_path(root: Path, rows: int, width: int, workers: int, enabled: bool) -> dict:
    """One 1-step run in this process; what it measured (JSON-able)."""
    model = root / "model"
    if not model.exists():
        size = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                               intermediate_size=128, max_position_embeddings=width)  # fmt: skip
        save_tiny_model(model, size)
    data = write_rows(conversations(rows, width), root / f"train-{rows}.jsonl")
    config = config_from_overrides(
        SFTConfig,
        [
            f"model_path={model}",
            f"data.train_path={data}",
            f"data.max_length={width}",
            "data.truncation=right",
            f"trainer.global_batch_size={rows}",
            "trainer.total_steps=1",
            f"trainer.n_workers={workers}",
            "trainer.report=false",
            "trainer.log_every=100",
            "engine.use_packing=true",
            f"engine.max_tokens_per_micro_batch={max(width, 16384)}",
            f"trainer.output_dir={root / ('on' if enabled else 'off') / str(rows)}",
            f"dataplane.enabled={'true' if enabled else 'false'}",
        ],
    )
    trainer = MeasuredSFT(config)
    lengths = trainer.train.lengths
    trainer.fit()
    return {
        **trainer.measured,
        "run_peak_mb": peak_rss_mb(),
        "rows": rows,
        "width": max(lengths),
        "real_tokens": sum(lengths),
        "today_batch_bytes": SLOT_BYTES * rows * max(lengths),
    }


def in_fresh_process(root: Path, rows: int, width: int, workers: int, enabled: bool) -> dict:
    """:func:`run_path` in a new Python process (its peak RSS is its own); its result."""
    command = [
        sys.executable,
        __file__,
        "--child",
        str(root),
        str(rows),
        str(width),
        str(workers),
        str(int(enabled)),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread a process (the ranks inherit it)
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def big_step(args) -> None:
    """Both paths side by side (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="tandem-big-step-") as tmp:
        root = Path(tmp)
        on = in_fresh_process(root, args.step_rows, args.step_width, args.workers, True)
        today_rows = args.step_rows // args.today_scale // args.workers * args.workers  # divides over them
        off = in_fresh_process(root, today_rows, args.step_width, args.workers, False)
    scale = on["today_batch_bytes"] / off["today_batch_bytes"]
    off_step = off["step_floor_mb"] + (off["step_peak_mb"] - off["step_floor_mb"]) * scale
    print(f"SFT step: {on['rows']} rows, width {on['width']}, {on['real_tokens']:,} real tokens; "
          f"today's padded batch {on['today_batch_bytes'] / 2**30:.2f} GiB; {args.workers} spawned ranks")  # fmt: skip
    print(f"{'':>34} | {'data plane (full size)':>24} | {'today':>30}")
    print(f"{'rows':>34} | {on['rows']:>24,} | {off['rows']:>12,} (x{scale:.1f} -> full) ")
    print(f"{'controller peak RSS, run (MB)':>34} | {on['run_peak_mb']:>24.0f} | {off['run_peak_mb']:>12.0f}")
    print(f"{'controller peak RSS, step (MB)':>34} | {on['step_peak_mb']:>24.0f} | "
          f"{off['step_peak_mb']:>12.0f} -> {off_step:>6.0f} scaled")  # fmt: skip
    print(f"{'step floor RSS (MB)':>34} | {on['step_floor_mb']:>24.0f} | {off['step_floor_mb']:>12.0f}")
    print(f"{'controller batch bytes serialised':>34} | {on['controller_batch_bytes']:>24,} | "
          f"{off['controller_batch_bytes']:>12,} -> {off['controller_batch_bytes'] * scale:>12,.0f}")  # fmt: skip
    print(
        f"{'controller bytes put into a store':>34} | {on['controller_put_bytes']:>24,} | {off['controller_put_bytes']:>12,}"
    )
    print(f"{'step seconds':>34} | {on['step_s']:>24.1f} | {off['step_s']:>12.1f}")


if __name__ == "__main__" and sys.argv[1:2] == ["--child"]:
    root, rows, width, workers, enabled = sys.argv[2:7]
    result = run_path(Path(root), int(rows), int(width), int(workers), enabled == "1")
    print(json.dumps(result))
