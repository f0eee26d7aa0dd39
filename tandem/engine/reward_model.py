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

from tandem.engine.packing import Predictions
from tandem.engine.token_model import decoder_hidden_states
from tandem.engine.ulysses import SequenceParallel
from tandem.engine.value_model import scalar_head
from tandem.engine.varlen_attention import AttentionPlan


class TokenScoreModel(nn.Module):
    """``forward(input_ids, position_ids, ...) -> {"scores": [B, S]}`` fp32 (see the module docstring).

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

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        attention_plan: AttentionPlan | None = None,
        predictions: Predictions | None = None,
        with_sum_pi_squared: bool = False,
        sequence_parallel: SequenceParallel | None = None,
    ) -> dict[str, torch.Tensor]:
        """Per-token scores ``[B, S]``; the arguments are :class:`TokenLogProbModel`'s
        (``predictions`` is not needed: every token is scored where it stands)."""
        if with_sum_pi_squared:
            raise ValueError("a reward model has no token distribution: with_sum_pi_squared must be False")
        hidden = decoder_hidden_states(
            self.reward_model.base_model,
            input_ids,
            position_ids,
            attention_mask,
            cu_seqlens,
            attention_plan,
            sequence_parallel,
        )
        scores = scalar_head(self.reward_model.score, hidden).squeeze(-1)  # [B, S] (this rank's [1, T / P])
        if sequence_parallel is not None:
            scores = sequence_parallel.gather(scores)
        return {"scores": scores}
