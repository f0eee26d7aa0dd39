"""``TokenScoreModel``: a discriminative reward model — a decoder with a scalar head — whose
forward returns the head's score at every token.

``scores[:, t]`` is the reward of the sequence that ends at token ``t``, read from the hidden
state at ``t`` itself: at a sequence's last token it is what an HF
``...ForSequenceClassification`` model with one label returns as its logit (that class reads
the last non-padding token), so a model trained here exports as one and scores the same.
Like :class:`~tandem.engine.token_model.TokenLogProbModel` it wraps the HF model so that DDP
or FSDP2 sees one ordinary module, packed and padded rows alike.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.forward_request import ForwardRequest
from tandem.engine.token_model import decoder_hidden_states
from tandem.engine.value_model import scalar_head


class TokenScoreModel(nn.Module):
    """``forward(request) -> {"scores": [B, S]}`` fp32 (see the module docstring).

    ``reward_model`` is an HF ``...ForSequenceClassification`` model with one label: its decoder
    (``base_model``) and ``score`` head.
    """

    def __init__(self, reward_model: nn.Module) -> None:
        super().__init__()
        self.reward_model = reward_model

    @property
    def causal_lm(self) -> nn.Module:
        """The HF model (named like the policy's, so the engine treats every head alike)."""
        return self.reward_model

    def vocab_size(self) -> int:
        return self.reward_model.get_input_embeddings().weight.shape[0]

    def forward(self, request: ForwardRequest) -> dict[str, torch.Tensor]:
        """Per-token scores ``[B, S]`` of ``request``'s tokens (its ``predictions`` are not
        needed: every token is scored where it stands)."""
        hidden = decoder_hidden_states(self.reward_model.base_model, request)
        scores = scalar_head(self.reward_model.score, hidden).squeeze(-1)  # [B, S] (this rank's [1, T / P])
        if request.sequence_parallel is not None:
            scores = request.sequence_parallel.gather(scores)
        return {"scores": scores}
