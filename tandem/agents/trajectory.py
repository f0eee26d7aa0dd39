"""Multi-turn trajectories kept as tokens: the model's tokens as sampled, other turns as the
chat template's tokens for them — never decoded and re-tokenised.

A :class:`Trajectory` is the prompt's ids and, after them, every token of the episode with a
``loss_mask`` (1 on the model's tokens, 0 on tool results and user replies), the model tokens'
log-probs and weight versions (0 and -1 elsewhere). :class:`TurnEncoder` finds the tokens a
non-model turn adds: it renders a fixed two-message conversation with and without the new
messages and tokenises only the difference, plus whatever the template writes after the
model's end-of-turn token (ChatML's newline), which the model never samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.models.chat_literal import literal_template_ids
from tandem.protocol.generation import Completion

ANCHOR = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]


@dataclass
class Trajectory:
    """One episode (see the module docstring); ``messages`` is the conversation as text, for
    rewards and logs (the model's turns decoded once, never fed back)."""

    prompt_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    finish_reason: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    reward: float | None = None  # from an interaction that ends the episode with one, or a program
    splits: int = 0  # an agent program's requests that did not extend its history (new segments)
    # an agent program's row: where each segment after the first starts in token_ids (its positions restart)
    segment_starts: list[int] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # an agent program's own
    program_log: dict[str, str] = field(default_factory=dict)  # an agent program's fault, a command's output

    def add_model_turn(self, completion: Completion) -> None:
        """Append the model's sampled tokens (``loss_mask`` 1) with their log-probs and versions."""
        self.token_ids += list(completion.token_ids)
        self.loss_mask += [1] * len(completion.token_ids)
        self.log_probs += [float(v) for v in completion.log_probs]
        self.weight_versions += [int(v) for v in completion.weight_versions]
        self.turns += 1

    def add_other_turn(self, token_ids: list[int]) -> None:
        """Append a tool result or user reply as template tokens (``loss_mask`` 0)."""
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.log_probs += [0.0] * len(token_ids)
        self.weight_versions += [-1] * len(token_ids)

    @property
    def context_ids(self) -> tuple[int, ...]:
        """What the model is prompted with next: the prompt and everything after it."""
        return self.prompt_ids + tuple(self.token_ids)

    def model_tokens(self) -> int:
        return sum(self.loss_mask)


def final_answer(messages: list[dict]) -> str:
    """The text of the last model turn of a conversation (empty when there is none)."""
    return next((str(m["content"]) for m in reversed(messages) if m.get("role") == "assistant"), "")


class TurnEncoder:
    """The tokens of non-model turns appended after a model turn (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.anchor = tokenizer.apply_chat_template(ANCHOR, tokenize=False)
        end = tokenizer.eos_token
        at = self.anchor.rfind(end) if end else -1
        if at < 0 or not self.anchor[:at].endswith("y"):
            raise ValueError(
                f"the chat template does not end an assistant turn with the EOS token {end!r}; "
                "an agent loop needs to know where the model's turn ends"
            )
        self.after_turn = self.anchor[at + len(end) :]  # e.g. ChatML's "\n" after <|im_end|>
        # the anchor's tokens through its EOS: a special token, so the tokens after it never merge with it
        self.anchor_ids = list(tokenizer.encode(self.anchor[: at + len(end)], add_special_tokens=False))
        self.end_id = self.anchor_ids[-1]  # the end-of-turn token that closes a model turn

    def encode(self, messages: list[dict]) -> list[int]:
        """Tokens of ``messages`` (tool results, user replies) and the next generation prompt, as
        they follow a model turn that ended with the EOS token (``end_id``: a turn that stopped
        otherwise, on a stop string, is closed with it first: :func:`tandem.agents.loops.append_turns`).

        The messages' text is always tokenized as plain text: a special-token string inside a tool's
        output or a user reply (``<|im_end|>``) never becomes a control token, so a tool cannot
        close its turn and forge another (:mod:`tandem.models.chat_literal`).
        """
        full = self.tokenizer.apply_chat_template(
            [*ANCHOR, *messages], tokenize=False, add_generation_prompt=True
        )
        if not full.startswith(self.anchor):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its continuation"
            )
        ids = literal_template_ids(self.tokenizer, [*ANCHOR, *messages], add_generation_prompt=True)
        if ids[: len(self.anchor_ids)] != self.anchor_ids:
            raise ValueError(
                "the chat template's tokens of a conversation do not begin with its first turns'"
            )
        return ids[len(self.anchor_ids) :]
