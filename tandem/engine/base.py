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
    A reward model (``engine.head=reward``): ``scores[:, t]``, the reward of the sequence ending
    at token ``t``, read from the hidden state at ``t`` (0 on padding).

    On request a policy also gives, per position, ``[B, S, k]`` each: the ``k`` most likely next
    tokens (``top_ids``, int64, most likely first) and their log-probs (``top_log_probs``,
    detached), and the log-probs of the tokens the micro-batch names in ``gather_token_ids``
    (``gathered_log_probs``, differentiable); all from the same (temperature-scaled)
    distribution as ``log_probs``.
    """

    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    values: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    gathered_log_probs: torch.Tensor | None = None

    def fields(self) -> dict[str, torch.Tensor]:
        """The outputs present, by name."""
        return {name: getattr(self, name) for name in OUTPUT_NAMES if getattr(self, name) is not None}

    def sequence_summary(self, mask: torch.Tensor) -> torch.Tensor:
        """One number per row of ``mask [B, S]`` (a row's response tokens): a reward model's
        score at the row's last ``mask`` token, else the log-prob summed over its ``mask``
        tokens. ``[B]``; a row with no ``mask`` token gives 0."""
        if self.scores is not None:
            return last_token_values(self.scores, mask)
        assert self.log_probs is not None
        return (self.log_probs * mask.to(self.log_probs.dtype)).sum(-1)

    def detach(self) -> TokenOutputs:
        """The same outputs cut from the autograd graph."""
        return TokenOutputs(**{name: value.detach() for name, value in self.fields().items()})


def last_token_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's value at its last ``mask`` token: ``values, mask [B, S] -> [B]`` (0 for a row
    without one)."""
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask.bool(), positions, -1).amax(-1)
    picked = values.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(last >= 0, picked, torch.zeros_like(picked))


OUTPUT_NAMES = (
    "log_probs",
    "entropy",
    "sum_pi_squared",
    "values",
    "scores",
    "top_ids",
    "top_log_probs",
    "gathered_log_probs",
)
GATHER_FIELD = "gather_token_ids"  # [B, S, k] int64 in a micro-batch: the tokens whose log-probs to return


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
        top_k: int = 0,
    ) -> StepResult: ...

    def zero_grad(self) -> None: ...

    last_step_skipped: bool  # the last optimizer_step left the weights alone (non-finite loss or norm)

    def optimizer_step(self, skip: bool = False) -> float: ...

    def lr_step(self) -> float: ...

    def iter_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def health(self, probe: Batch | None = None) -> ModelHealth: ...

    def offload(self, model: bool = True, optimizer: bool = True) -> None: ...

    def reload(self, model: bool = True, optimizer: bool = True) -> None: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...
