"""``TokenLogProbModel``: a causal LM whose forward returns per-token log-probs and entropy (and on
request ``sum_v p(v)^2``) of one :class:`~tandem.engine.forward_request.ForwardRequest`.

Wrapping the HF model this way puts the fp32 chunked head inside the module that DDP or
FSDP2 wraps, so data-parallel hooks see one ordinary forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from tandem.engine.forward_request import ForwardRequest
from tandem.engine.packing import Predictions, next_token_predictions
from tandem.engine.ulysses import SequenceParallel
from tandem.engine.ulysses_attention import SEQUENCE_PARALLEL_KEYWORD
from tandem.engine.varlen_attention import PLAN_KEYWORD
from tandem.engine.vision_inputs import decoder_inputs
from tandem.engine.vocab_parallel import vocab_parallel_log_probs_from_hidden
from tandem.models.logprobs import HeadOutputs, log_probs_from_hidden


def decoder_hidden_states(
    decoder: nn.Module, request: ForwardRequest, inputs: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """The decoder's last hidden states ``[B, S, H]`` of ``request``'s tokens: a packed row (its
    ``attention_plan``: varlen attention, possibly with shared prompts) or padded rows (its
    ``attention_mask``).

    With ``request.sequence_parallel`` the packed row ``[1, T]`` (and its plan) is whole and the
    states come back for this rank's shard only: ``[1, T / P, H]``. ``inputs`` replace the
    decoder's ``input_ids`` and ``position_ids`` (a vision-language model's merged embeddings
    ``[1, T, H]`` and M-RoPE positions ``[3, 1, T]``:
    :func:`tandem.engine.vision_inputs.decoder_inputs`); under sequence parallelism they are cut
    to this rank's shard along the sequence like the tokens.
    """
    attention = {}
    if inputs is None:
        inputs = {"input_ids": request.input_ids, "position_ids": request.position_ids}
    sequence_parallel, plan = request.sequence_parallel, request.attention_plan
    if sequence_parallel is not None:  # this rank's tokens; attention sees the whole row
        if plan is None:
            raise ValueError("a sequence-parallel forward needs the packed row's attention_plan")
        # the sequence is the last dimension of positions ([1, T] or M-RoPE's [3, 1, T]), the second of the rest
        inputs = {
            name: sequence_parallel.shard(values, dim=values.dim() - 1 if name == "position_ids" else 1)
            for name, values in inputs.items()
        }
        attention = {PLAN_KEYWORD: plan, SEQUENCE_PARALLEL_KEYWORD: sequence_parallel}
    elif plan is not None:  # packed row, possibly with shared prompts
        attention = {PLAN_KEYWORD: plan}
    return decoder(
        **inputs,
        attention_mask=request.attention_mask,
        use_cache=False,
        **attention,
    ).last_hidden_state


@dataclass
class PredictingStates:
    """The hidden states a rank predicts tokens from, and how per-prediction values go back.

    Attributes:
        states: ``[N_r, H]`` this rank's predicting hidden states (all ``N`` without sequence
            parallelism).
        targets: ``[N_r]`` the flat positions of the tokens they predict.
        predictions: every rank's predictions (``N`` of them).
        mine: which of them are this rank's (sequence parallelism), else None.
        sequence_parallel: the rank's group, or None.
        shape: the ``[B, S]`` shape of the input ids.
    """

    states: torch.Tensor
    targets: torch.Tensor
    predictions: Predictions
    mine: Any
    sequence_parallel: SequenceParallel | None
    shape: torch.Size

    def placed(self, values: torch.Tensor) -> torch.Tensor:
        """``values [N_r, ...]`` of this rank's predictions -> ``[B, S, ...]`` at the predicted
        tokens (every rank's, gathered over a sequence-parallel group), 0 where nothing is
        predicted."""
        if self.sequence_parallel is not None:  # [N_r] -> [N]: every rank's predictions
            values = self.sequence_parallel.gather_predicted(
                values, self.mine, self.predictions.targets.numel()
            )
        trailing = values.shape[1:]
        zeros = values.new_zeros(self.shape.numel(), *trailing)
        return zeros.index_put((self.predictions.targets,), values).view(*self.shape, *trailing)


def predicting_states(
    decoder: nn.Module, request: ForwardRequest, inputs: dict[str, torch.Tensor] | None = None
) -> PredictingStates:
    """Run the decoder (:func:`decoder_hidden_states`, on ``inputs`` when given) and pick the
    hidden states that predict tokens (``request.predictions``, default: each token from the one
    before it in its sequence, by the 1-D ``position_ids``); under sequence parallelism, this
    rank's share of them."""
    hidden = decoder_hidden_states(decoder, request, inputs)
    predictions = request.predictions
    if predictions is None:
        predictions = next_token_predictions(request.position_ids)
    computed, mine, sequence_parallel = predictions, None, request.sequence_parallel
    if sequence_parallel is not None:
        computed, mine = sequence_parallel.split_predictions(predictions, request.input_ids.shape[1])
    states = hidden.reshape(-1, hidden.shape[-1]).index_select(0, computed.sources)
    return PredictingStates(
        states, computed.targets, predictions, mine, sequence_parallel, request.input_ids.shape
    )


class TokenLogProbModel(nn.Module):
    """``forward(request) -> {"log_probs", "entropy"[, "sum_pi_squared"]}``, each ``[B, S]`` fp32
    (``sum_pi_squared`` only with ``request.with_sum_pi_squared``).

    ``log_probs[:, t] = log p(input_ids[:, t] | input_ids[:, <t])`` and ``entropy[:, t]`` is the
    entropy of that predictive distribution; position 0 has no prediction and holds 0.
    Packed rows (``attention_mask=None`` with restarting ``position_ids``) also work: the first
    token of every packed sequence gets 0 too. With explicit ``predictions`` only the named
    tokens get values (the RL engine asks for response tokens only).
    """

    def __init__(
        self,
        causal_lm: nn.Module,
        chunk_size: int = 1024,
        temperature: float = 1.0,
        head_dtype: str = "float32",
        vocab_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.chunk_size = chunk_size
        self.temperature = temperature
        self.head_dtype = head_dtype  # the head product's precision (tandem.models.logprobs)
        self.vocab_group = vocab_group  # tensor parallelism: the group the head's rows are split over
        self.vocab_rows = 0  # 0: every row of the head scores; else only the first rows (restrict_vocabulary)

    def restrict_vocabulary(self, rows: int) -> None:
        """Score over the head's first ``rows`` token ids only: log-probs, entropy and top-k are of
        the softmax renormalised over them, and an input id at or past ``rows`` is refused (a
        teacher whose head is padded beyond its student's vocabulary, :mod:`tandem.rl.teacher_worker`)."""
        full = self._output_weight().shape[0]
        if not 0 < rows <= full:
            raise ValueError(f"the head has {full} rows: cannot score over the first {rows}")
        if self.vocab_group is not None and rows < full:
            raise ValueError(
                "a vocabulary split over tensor-parallel ranks cannot be restricted to its first rows"
            )
        self.vocab_rows = rows if rows < full else 0

    def decoder(self) -> nn.Module:
        model = self.causal_lm
        if hasattr(model, "get_base_model"):  # a PEFT wrapper: LoRA layers live inside the base model
            model = model.get_base_model()
        return model.get_decoder()

    def _output_weight(self) -> torch.Tensor:
        model = (
            self.causal_lm.get_base_model() if hasattr(self.causal_lm, "get_base_model") else self.causal_lm
        )
        return model.get_output_embeddings().weight

    def head_weight(self) -> torch.Tensor:
        """``[V, H]``: the output head's rows that score (all, or the first ``vocab_rows``)."""
        weight = self._output_weight()
        return weight[: self.vocab_rows] if self.vocab_rows else weight

    def forward(self, request: ForwardRequest) -> dict[str, torch.Tensor]:
        """Per-token log-probs, entropy and (``request.with_sum_pi_squared``) ``sum_v p(v)^2``
        ``[B, S]`` of ``request``'s tokens; positions that nothing predicts hold 0. With
        ``request.top_k`` also ``top_ids`` and ``top_log_probs`` ``[B, S, k]`` (the most likely
        tokens at each position); with ``request.gather_ids [B, S, k']`` (the tokens each
        position names, aligned with ``input_ids``) also their log-probs
        ``gathered_log_probs [B, S, k']``.

        ``request.predictions`` names which hidden states predict which tokens (default: each
        token from the one before it within its sequence). With ``request.sequence_parallel``
        the packed row is split over its group: this rank runs the decoder and the head on its
        shard, and the outputs of the whole row come back on every rank. With ``vocab_group``
        (tensor parallelism) the head's weight is a DTensor of vocabulary rows and the
        log-softmax is vocabulary-parallel (:mod:`tandem.engine.vocab_parallel`). A
        vision-language model reads ``request.vision`` (its images and M-RoPE positions,
        :mod:`tandem.engine.vision_inputs`): the vision tower runs here, inside the wrapped module.
        """
        vision = request.vision
        inputs = None if vision is None else decoder_inputs(self.causal_lm, request.input_ids, vision)
        picked = predicting_states(self.decoder(), request, inputs)
        head = self._head_outputs(picked, request)
        outputs = {
            "log_probs": head.log_probs,
            "entropy": head.entropy,
            "sum_pi_squared": head.sum_pi_squared,
            "top_ids": head.top_ids,
            "top_log_probs": head.top_log_probs,
            "gathered_log_probs": head.gathered_log_probs,
        }
        return {name: picked.placed(values) for name, values in outputs.items() if values is not None}

    def _head_outputs(self, picked: PredictingStates, request: ForwardRequest) -> HeadOutputs:
        """The head's outputs ``[N_r]`` (``[N_r, k]`` for top-k and gathered tokens) at this rank's
        predicting states ``picked`` for the tokens of ``request.input_ids [B, S]`` they predict:
        the vocabulary-parallel head under ``vocab_group``, else the chunked fp32 (or bf16) one."""
        input_ids, top_k, gather_ids = request.input_ids, request.top_k, request.gather_ids
        with_sum_pi_squared = request.with_sum_pi_squared
        labels = input_ids.reshape(-1).index_select(0, picked.targets)
        weight = self.head_weight()
        settings = (self.temperature, self.chunk_size, with_sum_pi_squared, self.head_dtype)
        if self.vocab_group is not None:  # a DTensor of this rank's vocabulary rows
            if top_k or gather_ids is not None:
                raise ValueError(
                    "the teacher's top-k tokens (teacher.top_k, the jsd objective) are not computed under tensor "
                    "parallelism yet: set teacher.top_k=0 or tp_size=1"
                )
            return vocab_parallel_log_probs_from_hidden(
                picked.states, weight.to_local(), labels, weight.shape[0], self.vocab_group, *settings
            )
        named = None
        if gather_ids is not None:  # [B, S, k] -> [N_r, k] at the predicted tokens, as the labels
            named = gather_ids.reshape(-1, gather_ids.shape[-1]).index_select(0, picked.targets)
        return log_probs_from_hidden(picked.states, weight, labels, *settings, top_k=top_k, gather_ids=named)

    def vocab_size(self) -> int:
        return self.vocab_rows or self._output_weight().shape[0]
