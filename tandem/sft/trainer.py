"""The SFT loop: sample conversations, one optimizer step per global batch, evaluate, checkpoint, export."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from pathlib import Path

from rich.console import Console

from tandem.engine import TorchTrainEngine
from tandem.engine.divergence import SkippedUpdates, check_health
from tandem.models.loading import check_vocab_compatible, load_tokenizer
from tandem.protocol import Batch
from tandem.run_dir import OutputDirLock, atomic_directory, check_output_dir
from tandem.sft.config import SFTConfig
from tandem.sft.data import SFTDataset
from tandem.sft.loss import sft_loss
from tandem.sft.sampler import EpochSampler

STATE_FILE = "trainer_state.json"


@dataclasses.dataclass
class SFTResult:
    """Per-step training losses, the evaluation losses by step, and where the final model went."""

    train_losses: list[float]
    eval_losses: dict[int, float]
    hf_model_dir: Path


class SFTTrainer:
    """Supervised fine-tuning of a causal LM on chat data with the torch engine.

    :class:`tandem.dpo.DPOTrainer` builds on it: the engine, checkpoints, resume, divergence
    checks and export are shared; the data and the step differ."""

    def __init__(self, config: SFTConfig, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.output_dir = check_output_dir(config.trainer.output_dir, "trainer.output_dir")
        model_path = config.engine.model_path or config.model_path
        self.engine_config = dataclasses.replace(config.engine, model_path=model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.train, self.val = self.load_data()
        steps_per_epoch = -(-len(self.train) // config.trainer.global_batch_size)
        self.total_steps = config.trainer.total_steps or steps_per_epoch * config.trainer.epochs
        if self.engine_config.lr_schedule != "constant" and self.engine_config.total_steps == 0:
            self.engine_config = dataclasses.replace(self.engine_config, total_steps=self.total_steps)
        self.engine = TorchTrainEngine(self.engine_config)
        self.sampler = EpochSampler(len(self.train), config.trainer.seed)
        self.skipped = SkippedUpdates(
            config.trainer.max_skipped_updates_in_a_row, "trainer.max_skipped_updates_in_a_row"
        )
        self.step = 0

    def load_data(self) -> tuple[SFTDataset, SFTDataset | None]:
        """The training and (when ``data.val_path`` is set) validation sets."""
        data = self.config.data
        val = SFTDataset.load(data.val_path, self.tokenizer, data) if data.val_path else None
        return SFTDataset.load(data.train_path, self.tokenizer, data), val

    def fit(self) -> SFTResult:
        """Train for ``total_steps``; returns the losses and the exported model directory.

        The run holds ``trainer.output_dir`` for its duration: a second run there is refused.
        """
        with OutputDirLock(self.output_dir, "trainer.output_dir"):
            return self._fit()

    def _fit(self) -> SFTResult:
        trainer = self.config.trainer
        self.engine.initialize()
        check_vocab_compatible(self.engine.causal_lm, self.tokenizer)
        if trainer.resume:
            self._resume()
        self.console.print(
            f"[bold]SFT[/] {len(self.train)} conversations ({self.train.dropped} dropped as too long), "
            f"{self.total_steps} steps of {trainer.global_batch_size}, starting at step {self.step}"
        )
        train_losses: list[float] = []
        eval_losses: dict[int, float] = {}
        started, tokens = time.monotonic(), 0
        while self.step < self.total_steps:
            batch = self.train.collate(
                self.sampler.take(trainer.global_batch_size), self.tokenizer.pad_token_id
            )
            normalizer = self.engine.global_normalizer(batch["loss_mask"])
            result = self.engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
            grad_norm = self.engine.optimizer_step(skip=not math.isfinite(result.loss))
            self.engine.lr_step()
            self.step += 1
            self._check_divergence(batch[:1])
            tokens += int(batch["attention_mask"].sum())
            train_losses.append(result.loss)
            if self.step % trainer.log_every == 0 or self.step == self.total_steps:
                rate = tokens / max(time.monotonic() - started, 1e-9)
                self.console.print(
                    f"step {self.step}/{self.total_steps}  loss {result.loss:.4f}  grad_norm {grad_norm:.3f}  "
                    f"lr {self.engine.lr:.2e}  {rate:,.0f} tok/s"
                )
            if self.val is not None and trainer.eval_every and self.step % trainer.eval_every == 0:
                eval_losses[self.step] = self.evaluate()
                self.console.print(f"step {self.step}  eval_loss {eval_losses[self.step]:.4f}")
            if trainer.save_every and self.step % trainer.save_every == 0:
                self.save_checkpoint()
        if self.val is not None and self.total_steps not in eval_losses:
            eval_losses[self.total_steps] = self.evaluate()
            self.console.print(f"final eval_loss {eval_losses[self.total_steps]:.4f}")
        self.save_checkpoint()
        return SFTResult(train_losses, eval_losses, self.export())

    def _check_divergence(self, probe: Batch) -> None:
        """Count a skipped step; stop (naming the step) after too many in a row, or when the
        weights or ``probe``'s log-probs are no longer finite, before anything is saved."""
        self.skipped.record(self.engine.last_step_skipped)
        if self.engine.last_step_skipped:
            self.console.print(f"[yellow]step {self.step}: loss or gradient norm not finite; update skipped")
        self.skipped.check(self.step)
        check_health([self.engine.health(probe)], self.step, self._latest_checkpoint)

    def evaluate(self) -> float:
        """Mean assistant-token NLL over the whole validation set."""
        assert self.val is not None
        batch = self.val.collate(list(range(len(self.val))), self.tokenizer.pad_token_id)
        normalizer = self.engine.global_normalizer(batch["loss_mask"])
        return self.engine.forward_backward(
            batch, functools.partial(sft_loss, normalizer=normalizer), forward_only=True
        ).loss

    def save_checkpoint(self) -> Path:
        """Engine state plus the trainer's step and sampler position, under ``checkpoints/step_<n>``."""
        path = self.output_dir / "checkpoints" / f"step_{self.step}"
        self.engine.save(str(path))
        (path / STATE_FILE).write_text(json.dumps({"step": self.step, "sampler": self.sampler.state()}))
        return path

    def _latest_checkpoint(self) -> Path | None:
        checkpoints = sorted(
            (p for p in (self.output_dir / "checkpoints").glob("step_*") if (p / STATE_FILE).exists()),
            key=lambda p: int(p.name.split("_")[1]),
        )
        return checkpoints[-1] if checkpoints else None

    def _resume(self) -> None:
        latest = self._latest_checkpoint()
        if latest is None:
            self.console.print(f"no checkpoint in {self.output_dir}; starting fresh")
            return
        self.engine.load(str(latest))
        state = json.loads((latest / STATE_FILE).read_text())
        self.step = state["step"]
        self.sampler.load_state(state["sampler"])
        self.console.print(f"resumed from {latest}")

    def export(self) -> Path:
        """Save the trained model (LoRA merged) and tokenizer as a plain HF directory."""
        target = self.output_dir / "hf_model"
        model = self.engine.causal_lm
        if self.engine_config.lora.rank:
            model = model.merge_and_unload()
        with atomic_directory(target) as staging:
            model.save_pretrained(staging)
            self.tokenizer.save_pretrained(staging)
        return target
