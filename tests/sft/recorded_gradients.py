"""SFT and DPO trainers whose ranks record every optimizer step's gradients, and the comparison
of two such runs: the gradients tightly, the weights within the Adam bound of those gradients
(:mod:`tests.sft.adam_bound`)."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.controller import register
from tandem.dpo import DPOTrainer
from tandem.dpo.worker import PreferenceWorker
from tandem.engine import EngineConfig
from tandem.models.loading import load_model
from tandem.sft import SFTTrainer
from tandem.sft.engine_worker import EngineWorker
from tests.sft.adam_bound import adam_gap_bound

GRADIENT_TOLERANCE = 1e-5  # max abs difference of two layouts' clipped gradients (fp32, reduction order)
ROUNDING = 1e-6  # float32 updates: a few ulps a step of weights |w| <= 1 (norms), fused against foreach AdamW


class GradientRecordingWorker(EngineWorker):
    """An :class:`EngineWorker` whose rank 0 saves the gradients each optimizer step applies
    (clipped, whole: sharded ones gathered on every rank) as ``<record_dir>/step<N>.pt``."""

    def __init__(self, record_dir: str, *args) -> None:
        super().__init__(*args)
        self.record_dir = Path(record_dir)

    @register(dispatch="ONE_TO_ALL")
    def init_engine(self) -> int:
        rows = EngineWorker.init_engine(self)
        self.engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._record())
        return rows

    def _record(self) -> None:
        gradients = {}
        for name, param in self.engine.causal_lm.named_parameters():
            if param.requires_grad and param.grad is not None:
                grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
                gradients[name] = grad.detach().cpu().clone()
        if self.rank == 0:
            self.record_dir.mkdir(parents=True, exist_ok=True)
            torch.save(gradients, self.record_dir / f"step{self.engine.step_count + 1}.pt")


class GradientRecordingPreferenceWorker(GradientRecordingWorker, PreferenceWorker):
    """:class:`GradientRecordingWorker` with the DPO rank's declared reads (``chosen``,
    ``response_row``, ...): with ``dataplane.enabled`` a rank fetches only the fields its methods
    declare, and collates its pairs from them."""


class RecordingSFTTrainer(SFTTrainer):
    """:class:`SFTTrainer` recording its steps' gradients under ``<trainer.output_dir>/gradients``."""

    worker_class = GradientRecordingWorker

    def worker_args(self) -> tuple:
        return (str(self.output_dir / "gradients"), *super().worker_args())


class RecordingDPOTrainer(DPOTrainer):
    """:class:`DPOTrainer` recording its steps' gradients under ``<trainer.output_dir>/gradients``."""

    worker_class = GradientRecordingPreferenceWorker

    def worker_args(self) -> tuple:
        return (str(self.output_dir / "gradients"), *super().worker_args())


def recorded_gradients(output_dir: Path, steps: int) -> list[dict[str, torch.Tensor]]:
    return [torch.load(Path(output_dir) / "gradients" / f"step{step}.pt") for step in range(1, steps + 1)]


def assert_same_steps(
    one: tuple[Path, Path], two: tuple[Path, Path], engine: EngineConfig, steps: int
) -> dict[str, float]:
    """Two runs of ``steps`` AdamW steps from the same model, each given as its
    ``(trainer.output_dir, exported model dir)``: every step's gradients agree within
    ``GRADIENT_TOLERANCE``, and every exported weight within the Adam bound of those gradients
    (constant ``engine.lr``, no weight decay) plus ``ROUNDING``. Returns the largest gradient
    difference (and its step) and the largest weight gap (and its bound) for a report."""
    if engine.weight_decay or engine.lr_schedule != "constant" or engine.warmup_steps:
        raise ValueError("the Adam bound here assumes a constant engine.lr and engine.weight_decay=0")
    grads_one, grads_two = recorded_gradients(one[0], steps), recorded_gradients(two[0], steps)
    weights_one, weights_two = load_model(one[1]).state_dict(), load_model(two[1]).state_dict()
    assert weights_one.keys() == weights_two.keys()
    worst = {"gradient": 0.0, "gradient_step": 0, "weight": 0.0, "weight_bound": 0.0}
    for name, weight in weights_one.items():
        if not any(name in step for step in grads_one):  # frozen: both runs keep the starting weight
            torch.testing.assert_close(weights_two[name], weight, rtol=0, atol=ROUNDING, msg=name)
            continue
        left, right = [step[name] for step in grads_one], [step[name] for step in grads_two]
        for step, (g, h) in enumerate(zip(left, right, strict=True), start=1):
            torch.testing.assert_close(
                h, g, rtol=0, atol=GRADIENT_TOLERANCE, msg=f"step {step} gradient of {name}"
            )
            gap = float((g.double() - h.double()).abs().max())
            if gap > worst["gradient"]:
                worst |= {"gradient": gap, "gradient_step": step}
        bound = adam_gap_bound(left, right, [engine.lr] * steps, engine.betas, engine.eps)
        gap = (weight.double() - weights_two[name].double()).abs()
        beyond = gap > bound + ROUNDING
        assert not bool(beyond.any()), (
            f"{name}: {int(beyond.sum())} weights apart by more than the Adam bound of their gradients "
            f"(worst gap {float(gap.max()):.3g}, its bound {float(bound.flatten()[gap.argmax()]):.3g})"
        )
        if float(gap.max()) > worst["weight"]:
            worst |= {"weight": float(gap.max()), "weight_bound": float(bound.flatten()[gap.argmax()])}
    return worst
