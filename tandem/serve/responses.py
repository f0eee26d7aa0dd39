"""Response bodies in OpenAI's shapes, plus tandem's token-space extension fields.

Extensions on every choice: ``token_ids`` (the sampled response tokens, stop tokens
included), ``weight_versions`` (the policy version of each token) and ``prompt_token_ids``;
on the response: ``weight_version`` (the newest version any token was sampled under).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from tandem.serve.text import IncrementalText, token_strings


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ChoiceState:
    """One choice as it grows: its text (stop strings cut) and per-token records."""

    index: int
    prompt_ids: list[int]
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprob_chars: int = 0  # characters of the token strings reported so far (completions' text_offset)

    def add(self, token_ids: list[int], log_probs: list[float], versions: list[int]) -> str:
        """Record tokens; returns the text they make safe to emit."""
        self.token_ids.extend(token_ids)
        self.log_probs.extend(log_probs)
        self.versions.extend(versions)
        return self.text.push(token_ids)

    def absorb(self, completion) -> tuple[str, list[int], list[float], list[int]]:
        """Record the finished completion's tokens not seen yet (all of them when not streaming).

        Returns the text they make safe to emit and the tokens, log-probs and versions added.
        """
        seen = len(self.token_ids)
        new = (completion.token_ids[seen:], completion.log_probs[seen:], completion.weight_versions[seen:])
        return (self.add(*new), *new)

    def finish(self, reason: str) -> str:
        self.finish_reason = reason
        return self.text.finish()


class ResponseBuilder:
    """Builds the JSON bodies (whole responses and stream chunks) of one request."""

    def __init__(self, kind: str, model: str, tokenizer, want_logprobs: bool) -> None:
        assert kind in ("completion", "chat")
        self.kind = kind
        self.model = model
        self.tokenizer = tokenizer
        self.want_logprobs = want_logprobs
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())

    # ------------------------------------------------------------------ pieces
    def logprobs(self, token_ids: list[int], log_probs: list[float], offset: int = 0) -> dict | None:
        """OpenAI logprobs for these tokens (``offset``: characters before them, completions only)."""
        if not self.want_logprobs:
            return None
        strings = token_strings(self.tokenizer, token_ids)
        if self.kind == "chat":
            return {
                "content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
                    for s, lp in zip(strings, log_probs, strict=True)
                ]
            }
        offsets, position = [], offset
        for s in strings:
            offsets.append(position)
            position += len(s)
        return {"tokens": strings, "token_logprobs": log_probs, "top_logprobs": None, "text_offset": offsets}

    @staticmethod
    def usage(choices: list[ChoiceState], prompts: list[list[int]]) -> dict:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    # ------------------------------------------------------------------ whole responses
    def response(self, choices: list[ChoiceState], prompts: list[list[int]], version: int) -> dict:
        body_choices = []
        for c in choices:
            text = c.text.text
            entry = {"index": c.index}
            if self.kind == "chat":
                entry["message"] = {"role": "assistant", "content": text}
            else:
                entry["text"] = text
            entry["logprobs"] = self.logprobs(c.token_ids, c.log_probs)
            entry["finish_reason"] = c.finish_reason
            entry |= {
                "token_ids": c.token_ids,
                "weight_versions": c.versions,
                "prompt_token_ids": c.prompt_ids,
            }
            body_choices.append(entry)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": body_choices,
            "usage": self.usage(choices, prompts),
            "weight_version": max((v for c in choices for v in c.versions), default=version),
        }
        if self.kind == "chat":
            body["prompt_token_ids"] = prompts[0]
        return body

    # ------------------------------------------------------------------ stream chunks
    def chunk(
        self,
        choice: ChoiceState,
        text: str,
        token_ids: list[int],
        log_probs: list[float],
        versions: list[int],
        finish_reason: str | None = None,
        first: bool = False,
    ) -> dict:
        entry: dict = {"index": choice.index}
        if self.kind == "chat":
            entry["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": text} if text or first else {}
            )
        else:
            entry["text"] = text
        entry["logprobs"] = self.logprobs(token_ids, log_probs, choice.logprob_chars) if token_ids else None
        if entry["logprobs"] and self.kind == "completion":
            choice.logprob_chars = entry["logprobs"]["text_offset"][-1] + len(entry["logprobs"]["tokens"][-1])
        entry["finish_reason"] = finish_reason
        entry |= {"token_ids": token_ids, "weight_versions": versions}
        if first:
            entry["prompt_token_ids"] = choice.prompt_ids
        return self._chunk_body([entry])

    def usage_chunk(self, choices: list[ChoiceState], prompts: list[list[int]]) -> dict:
        return self._chunk_body([]) | {"usage": self.usage(choices, prompts)}

    def _chunk_body(self, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
