"""``TokenLogProbModel``: a causal LM whose forward returns per-token log-probs and entropy.

Wrapping the HF model this way puts the fp32 chunked head inside the module that DDP or
FSDP2 wraps, so data-parallel hooks see one ordinary forward.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.logprobs import log_probs_from_hidden


class TokenLogProbModel(nn.Module):
    """``forward(input_ids, position_ids, attention_mask) -> (log_probs, entropy)``, both ``[B, S]`` fp32.

    ``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, <t])`` and ``entropy[:, t]`` is the
    entropy of that predictive distribution; position 0 has no prediction and holds 0.
    Packed rows (``attention_mask=None`` with restarting ``position_ids``) also work: the first
    token of every packed sequence gets 0 too.
    """

    def __init__(self, causal_lm: nn.Module, chunk_size: int = 1024, temperature: float = 1.0) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.chunk_size = chunk_size
        self.temperature = temperature

    def decoder(self) -> nn.Module:
        model = self.causal_lm
        if hasattr(model, "get_base_model"):  # a PEFT wrapper: LoRA layers live inside the base model
            model = model.get_base_model()
        return model.get_decoder()

    def head_weight(self) -> torch.Tensor:
        model = (
            self.causal_lm.get_base_model() if hasattr(self.causal_lm, "get_base_model") else self.causal_lm
        )
        return model.get_output_embeddings().weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        varlen = {}
        if cu_seqlens is not None:  # packed row: sequence boundaries for varlen attention kernels
            longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
            varlen = {
                "cu_seq_lens_q": cu_seqlens,
                "cu_seq_lens_k": cu_seqlens,
                "max_length_q": longest,
                "max_length_k": longest,
            }
        hidden = self.decoder()(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
            **varlen,
        ).last_hidden_state
        batch, length, width = hidden.shape
        # Position t predicts token t + 1: shift the labels left by one.
        predictors = hidden[:, :-1].reshape(-1, width)
        labels = input_ids[:, 1:].reshape(-1)
        log_probs, entropy = log_probs_from_hidden(
            predictors, self.head_weight(), labels, self.temperature, self.chunk_size
        )
        zero = log_probs.new_zeros(batch, 1)
        log_probs = torch.cat([zero, log_probs.reshape(batch, length - 1)], dim=1)
        entropy = torch.cat([zero, entropy.reshape(batch, length - 1)], dim=1)
        starts = position_ids == 0  # first token of a sequence: nothing predicts it
        return log_probs.masked_fill(starts, 0.0), entropy.masked_fill(starts, 0.0)
