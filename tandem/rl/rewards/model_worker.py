"""``RewardModelWorker``: a discriminative reward model scoring decoded responses, one rank of
a worker group of its own (``reward.model.*``).

Each rank loads the whole model (an HF ``...ForSequenceClassification`` with one label) on
its device with its own tokenizer, renders each ``(prompt messages, response)`` with that
tokenizer's chat template — the policy's tokenizer may differ — and reads the score head at
the last token (:class:`~tandem.engine.reward_model.TokenScoreModel`), packed into token-budget
micro-batches. A conversation longer than ``max_length`` keeps its last ``max_length`` tokens
(the response, which is what is judged) and is counted.
"""

from __future__ import annotations

import torch

from tandem.controller import Worker, register
from tandem.engine import EngineConfig
from tandem.engine.on_rank import bind_rank, parameter_count, start_engine
from tandem.models.chat import template_ids
from tandem.models.loading import load_tokenizer
from tandem.protocol import Batch
from tandem.rl.config import RewardModelSourceConfig


class RewardModelWorker(Worker):
    """One rank of the reward-model group (see the module docstring)."""

    def __init__(self, config: RewardModelSourceConfig, device: str) -> None:
        self.config = config
        self.device_setting = device

    @register(dispatch="ONE_TO_ALL")
    def init_model(self) -> int:
        """Load the model and tokenizer on this rank's device; returns the parameter count."""
        device = bind_rank(self, self.device_setting)
        config = self.config
        self.tokenizer = load_tokenizer(config.path)
        engine_config = EngineConfig(
            model_path=config.path,
            head="reward",
            device=str(device),
            param_dtype=config.param_dtype,
            max_tokens_per_micro_batch=max(config.max_tokens_per_micro_batch, config.max_length),
        )
        self.engine = start_engine(self, engine_config, frozen=True)  # DP_COMPUTE: dispatched by plain rank
        return parameter_count(self.engine)

    @register(dispatch="DP_COMPUTE")
    def score(self, batch: Batch) -> Batch:
        """``score [B]``, ``truncated [B]`` and ``failed [B]`` of the rows' ``raw_prompt`` (chat
        messages) answered by ``response_text``; a response this model's tokenizer cannot encode
        scores 0 and is ``failed``."""
        rows, failed = [], []
        for messages, response in zip(batch["raw_prompt"], batch["response_text"], strict=True):
            conversation = [*messages, {"role": "assistant", "content": response}]
            try:
                rows.append(template_ids(self.tokenizer, conversation, add_generation_prompt=False))
                failed.append(0.0)
            except Exception:  # text this tokenizer cannot encode: scored 0 and counted, never fatal
                rows.append(template_ids(self.tokenizer, list(messages), add_generation_prompt=True))
                failed.append(1.0)
        limit = self.config.max_length
        truncated = torch.tensor([len(ids) > limit for ids in rows], dtype=torch.float32)
        rows = [ids[-limit:] for ids in rows]
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(rows):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = 1
        tokens = Batch({"input_ids": input_ids, "attention_mask": mask})
        with torch.no_grad():
            outputs = self.engine.forward_backward(tokens, None, forward_only=True).outputs
        failures = torch.tensor(failed)
        scores = torch.where(failures.bool(), 0.0, outputs.sequence_summary(mask))
        return Batch({"score": scores, "truncated": truncated, "failed": failures})
