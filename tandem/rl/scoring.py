"""Scoring a generated batch: each response's text (an agent episode's final answer) through the
run's reward sources, into the per-token score the estimators read.

A draw whose per-token fields stay in the data plane (a ``BatchRef``,
:mod:`tandem.pipeline.stored_rollout`) is scored on its inline scalars alone: the texts the
generating ranks decoded, the response lengths and the ground truth. Its score stays a per-row
``sequence_score [B]``; the step's controller-side batch spreads it onto the last sampled token
(:func:`token_level_scores`) as the ``Batch`` path does here.
"""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console

from tandem.agents.trajectory import final_answer
from tandem.dataplane import BatchRef
from tandem.pipeline.stored_rollout import RESPONSE_TEXT
from tandem.protocol import Batch
from tandem.protocol.sequences import decode_responses, last_sampled_token, response_lengths
from tandem.rl.rewards.sources import RewardSources
from tandem.rl.row_fields import SEQUENCE_SCORE

__all__ = ["SEQUENCE_SCORE", "score_responses", "token_level_scores"]


def token_level_scores(scores: torch.Tensor, last_sampled: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, width]`` float32: ``scores [B]`` on each row's ``last_sampled [B]`` column, 0 elsewhere."""
    token_scores = torch.zeros((len(scores), width), dtype=torch.float32)
    token_scores[torch.arange(len(scores)), last_sampled] = scores.to(torch.float32)
    return token_scores


def score_responses(
    batch: Batch | BatchRef,
    rewards: RewardSources,
    tokenizer: Any,
    max_response_length: int,
    component_keys: tuple[str, ...],
    console: Console,
) -> tuple[Batch | BatchRef, dict[str, float]]:
    """``token_level_scores [B, R]`` (the score on each response's last sampled token), ``acc
    [B]`` and ``raw_score [B]``, and ``reward_components [B, K]`` when ``component_keys`` asks for
    them; and the reward metrics. Failed scorers score 0, reported on ``console``. A ``BatchRef``
    gets ``sequence_score [B]`` instead of ``token_level_scores`` and reads no stored field.

    An agent episode is scored on its final answer (the last model turn's text); its whole
    conversation is in the scorer's ``extra_info["messages"]``, and the reward an interaction
    ended it with (or None) in ``extra_info["interaction_reward"]``."""
    rows = batch.scalars if isinstance(batch, BatchRef) else batch
    lengths = response_lengths(rows)
    if "agent_messages" in rows:
        texts = [final_answer(messages) for messages in rows["agent_messages"]]
        rows = rows.assign(
            non_tensors={
                "extra_info": [
                    {**info, "messages": messages, "interaction_reward": reward}
                    for info, messages, reward in zip(
                        rows["extra_info"], rows["agent_messages"], rows["agent_reward"], strict=True
                    )
                ]
            }
        )
    elif RESPONSE_TEXT in rows:  # decoded where the response was generated
        texts = list(rows[RESPONSE_TEXT])
    else:
        texts = decode_responses(tokenizer, rows["responses"], lengths)
    result = rewards.score(rows, texts, lengths, max_response_length, component_keys)
    if result.errors:
        console.print(f"[yellow]reward: {len(result.errors)} failed ({result.errors[0]}); scored 0")
    if result.notes:
        console.print(f"[yellow]reward: {len(result.notes)} fields left out ({result.notes[0]})")
    tensors = {"acc": result.accuracy, "raw_score": result.raw_scores}
    if result.components is not None:
        tensors["reward_components"] = result.components
    if isinstance(batch, BatchRef):
        tensors[SEQUENCE_SCORE] = result.scores.to(torch.float32)
        return BatchRef(rows.assign(tensors=tensors), batch.parts, batch.schema), result.metrics
    mask = rows["response_mask"]
    tensors["token_level_scores"] = token_level_scores(result.scores, last_sampled_token(mask), mask.shape[1])
    return rows.assign(tensors=tensors), result.metrics
