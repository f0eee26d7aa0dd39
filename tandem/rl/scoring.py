"""Scoring a generated batch: each response's text (an agent episode's final answer) through the
run's reward sources, into the per-token score the estimators read."""

from __future__ import annotations

from typing import Any

import torch
from rich.console import Console

from tandem.agents.trajectory import final_answer
from tandem.protocol import Batch
from tandem.protocol.sequences import decode_responses, last_sampled_token, response_lengths
from tandem.rl.rewards.sources import RewardSources


def score_responses(
    batch: Batch,
    rewards: RewardSources,
    tokenizer: Any,
    max_response_length: int,
    component_keys: tuple[str, ...],
    console: Console,
) -> tuple[Batch, dict[str, float]]:
    """``token_level_scores [B, R]`` (the score on each response's last sampled token), ``acc
    [B]`` and ``raw_score [B]``, and ``reward_components [B, K]`` when ``component_keys`` asks for
    them; and the reward metrics. Failed scorers score 0, reported on ``console``.

    An agent episode is scored on its final answer (the last model turn's text); its whole
    conversation is in the scorer's ``extra_info["messages"]``, and the reward an interaction
    ended it with (or None) in ``extra_info["interaction_reward"]``."""
    mask = batch["response_mask"]
    lengths = response_lengths(batch)
    if "agent_messages" in batch:
        texts = [final_answer(messages) for messages in batch["agent_messages"]]
        batch = batch.assign(
            non_tensors={
                "extra_info": [
                    {**info, "messages": messages, "interaction_reward": reward}
                    for info, messages, reward in zip(
                        batch["extra_info"], batch["agent_messages"], batch["agent_reward"], strict=True
                    )
                ]
            }
        )
    else:
        texts = decode_responses(tokenizer, batch["responses"], lengths)
    result = rewards.score(batch, texts, lengths, max_response_length, component_keys)
    token_scores = torch.zeros(mask.shape, dtype=torch.float32)
    token_scores[torch.arange(len(batch)), last_sampled_token(mask)] = result.scores
    if result.errors:
        console.print(f"[yellow]reward: {len(result.errors)} failed ({result.errors[0]}); scored 0")
    if result.notes:
        console.print(f"[yellow]reward: {len(result.notes)} fields left out ({result.notes[0]})")
    tensors = {"token_level_scores": token_scores, "acc": result.accuracy, "raw_score": result.raw_scores}
    if result.components is not None:
        tensors["reward_components"] = result.components
    return batch.assign(tensors=tensors), result.metrics
