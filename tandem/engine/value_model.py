"""``TokenValueModel``: a critic — a decoder with a scalar head — whose forward returns ``V(s_t)`` per token.

The value of response token ``t`` is read from the hidden state of the token before it (the
state the action was taken in), exactly where the policy's head reads the log-prob of token
``t``; so the same :class:`~tandem.engine.packing.Predictions` place both, in packed and
padded rows, and shared-prompt packing works unchanged. Like :class:`TokenLogProbModel` it
wraps the HF model so that DDP or FSDP2 sees one ordinary module.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.forward_request import ForwardRequest
from tandem.engine.token_model import predicting_states


class TokenValueModel(nn.Module):
    """``forward(request) -> {"values": [B, S]}`` fp32 (:class:`~tandem.engine.forward_request.ForwardRequest`).

    ``values[:, t]`` is the critic's estimate of the return from token ``t`` on, computed
    from the hidden state at ``t - 1``; positions nothing predicts hold 0. ``value_model`` is
    an HF ``...ForTokenClassification`` model with one label: its decoder and ``score`` head.
    """

    def __init__(self, value_model: nn.Module) -> None:
        super().__init__()
        self.value_model = value_model

    @property
    def causal_lm(self) -> nn.Module:
        """The HF model (named like the policy's, so the engine treats both alike)."""
        return self.value_model

    def decoder(self) -> nn.Module:
        return self.value_model.base_model

    def vocab_size(self) -> int:
        return self.value_model.get_input_embeddings().weight.shape[0]

    def forward(self, request: ForwardRequest) -> dict[str, torch.Tensor]:
        """Per-token values ``[B, S]`` of ``request``'s tokens (a policy's extra outputs are
        refused once, when a step asks for them: :func:`~tandem.engine.forward_request.check_head_request`)."""
        picked = predicting_states(self.decoder(), request)
        return {"values": picked.placed(scalar_head(self.value_model.score, picked.states).squeeze(-1))}


def scalar_head(head: nn.Linear, states: torch.Tensor) -> torch.Tensor:
    """A one-output ``score`` head on ``states [..., H]`` in fp32 -> ``[..., 1]`` (its weights
    upcast, as the policy's output head is; outside autocast, which would run it in bf16)."""
    with torch.autocast(states.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return nn.functional.linear(states.float(), head.weight.float(), bias)
