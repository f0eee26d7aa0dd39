"""The ``TrainEngine`` protocol and the types its methods exchange.

The engine does not know the algorithm: ``forward_backward`` receives a loss function.
A loss function sees one micro-batch and the model's per-token outputs for it and returns
*its share* of the global loss (divide by global counts, see
:class:`tandem.algos.LossNormalizer`), plus metrics. The engine sums the shares over
micro-batches, and scales by the data-parallel size before backward so that DP
all-reduce averaging yields the gradient of the global loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.engine.divergence import ModelHealth
from tandem.protocol import Batch


@dataclass(frozen=True)
class TokenOutputs:
    """Per-token model outputs aligned with ``input_ids [B, S]``, fp32; each is None when the
    model does not produce it.

    A policy (``engine.head=lm``): ``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, <t])``
    and ``entropy[:, t]`` its predictive entropy, 0 at each sequence's first token and on
    padding; ``sum_pi_squared[:, t] = sum_v p(v | input_ids[:, <t])^2`` of the same
    (temperature-scaled) distribution, detached, when the caller asked for it.
    A critic (``engine.head=value``): ``values[:, t] = V(s_t)``, read from the hidden state at
    ``t - 1`` (0 where nothing predicts).
    """

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def fields(self) -> dict[str, torch.Tensor]:
        """The outputs present, by name."""
        return {name: getattr(self, name) for name in OUTPUT_NAMES if getattr(self, name) is not None}

    def detach(self) -> TokenOutputs:
        """The same outputs cut from the autograd graph."""
        return TokenOutputs(**{name: value.detach() for name, value in self.fields().items()})


OUTPUT_NAMES = ("log_probs", "entropy", "sum_pi_squared", "values")


LossFn = Callable[[Batch, TokenOutputs], tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class StepResult:
    """What ``forward_backward`` returns.

    Attributes:
        loss: the global loss (sum of the micro-batch shares) on this rank, a float.
        metrics: each metric the loss function returned, one value per micro-batch.
        outputs: with ``forward_only``, the outputs for the whole batch in its original order.
        num_micro_batches: how many micro-batches ran.
    """

    loss: float = 0.0
    metrics: dict[str, list[float]] = field(default_factory=dict)
    outputs: TokenOutputs | None = None
    num_micro_batches: int = 0


class TrainEngine(Protocol):
    """What every training engine offers (the torch one: :class:`tandem.engine.TorchTrainEngine`)."""

    def initialize(self) -> None: ...

    def forward_backward(
        self,
        batch: Batch,
        loss_fn: LossFn | None,
        forward_only: bool = False,
        with_sum_pi_squared: bool = False,
    ) -> StepResult: ...

    def zero_grad(self) -> None: ...

    last_step_skipped: bool  # the last optimizer_step left the weights alone (non-finite loss or norm)

    def optimizer_step(self, skip: bool = False) -> float: ...

    def lr_step(self) -> float: ...

    def iter_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def health(self, probe: Batch | None = None) -> ModelHealth: ...

    def to(
        self, device: str | torch.device, model: bool = True, optimizer: bool = True, grads: bool = True
    ) -> None: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...
