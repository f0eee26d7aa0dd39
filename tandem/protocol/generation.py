"""Requests, sampling parameters and completions exchanged with a rollout engine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from tandem.config.validation import check_choice, check_range
from tandem.protocol.images import ImageInputs

LOGPROBS_MODES = ("processed", "raw")
FinishReason = Literal["stop", "length", "abort", "error"]
TokenCallback = Callable[[int, float, int], None]
"""``on_token(token_id, log_prob, weight_version)``: called by an engine after each sampled token."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one response.

    Attributes:
        temperature: divides the logits; 0 means greedy.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability reaches p (1: all).
        max_tokens: most new tokens to generate.
        stop_token_ids: tokens that end the response (kept in it); EOS is added unless ``ignore_eos``.
        stop: strings that end the response once the decoded text contains one.
        ignore_eos: keep generating through EOS (fixed-length benchmarks).
        seed: per-request seed; the same seed gives the same tokens whatever else runs.
        logprobs_mode: ``processed`` — the log-probability under the distribution actually
            sampled from (after temperature, top-k, top-p; for greedy, the unscaled
            distribution) — or ``raw``, the model's unscaled log-softmax.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs_mode: str = "processed"

    def __post_init__(self) -> None:
        owner = "sampling"
        check_range(owner, "temperature", self.temperature, low=0.0)
        check_range(owner, "top_k", self.top_k, low=0)
        check_range(owner, "top_p", self.top_p, 0.0, 1.0, low_inclusive=False)
        check_range(owner, "max_tokens", self.max_tokens, low=1)
        check_choice(owner, "logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"{owner}.stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt to complete: token ids, sampling parameters and a unique id.

    For a vision-language model ``images`` holds the prompt's images, and ``prompt_ids`` already
    holds one ``<|image_pad|>`` token per image token, image after image
    (:func:`tandem.models.vision.expand_image_tokens`).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    images: ImageInputs | None = None


def prompt_problem(prompt: tuple[int, ...], max_model_len: int, vocab_size: int) -> str | None:
    """Why an engine cannot take this prompt (empty, too long, unknown ids), or ``None``."""
    if not prompt:
        return "the prompt is empty"
    if len(prompt) >= max_model_len:
        return f"the prompt has {len(prompt)} tokens; the context limit is {max_model_len}"
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        return f"unknown token ids {bad[:5]} (the vocabulary has {vocab_size})"
    return None


@dataclass
class Completion:
    """A finished request.

    Attributes:
        token_ids: the response tokens (a stop token is included, padding never).
        log_probs: one per response token, under ``logprobs_mode``.
        weight_versions: the policy version each response token was sampled under.
        finish_reason: ``stop`` (EOS/stop token/stop string), ``length`` (max_tokens or the
            context limit), ``abort`` or ``error``.
        error: the message when ``finish_reason == "error"``.
        token_mask: 1 on the tokens the model sampled, 0 on tokens an agent loop put between
            its turns (tool results, user replies); None: every token was sampled.
        routed_experts: a mixture-of-experts model's routing, ``[len(prompt_ids) +
            len(token_ids), L, k]`` int16: the experts each prompt and response token was routed
            to as the engine's input, per MoE layer (-1 where no forward routed it: the last
            response token); None for a dense model or an engine that does not record it.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    token_mask: list[int] | None = None
    routed_experts: torch.Tensor | None = None


def raise_failed_requests(completions: Sequence[Completion], where: str) -> None:
    """Raise ``RuntimeError`` when a completion finished with ``error``, naming ``where``, how
    many failed and the first one (its request and the engine's reason); return otherwise.

    Every path that generates for training or validation runs this one check, so a failed
    request stops each of them with the same message rather than passing on as an empty response.
    """
    failed = [c for c in completions if c.finish_reason == "error"]
    if not failed:
        return
    first = failed[0]
    reason = first.error or "no reason given"
    if first.request_id not in reason:  # the native and HF engines already name the request
        reason = f"request {first.request_id!r}: {reason}"
    raise RuntimeError(
        f"{where}: {len(failed)} of {len(completions)} rollout requests failed; first: {reason}"
    )


@dataclass
class EngineMetrics:
    """A monitoring snapshot of a rollout engine (the server's ``/metrics``).

    Attributes:
        running / waiting: requests generating now / queued for admission.
        generated_tokens / prompt_tokens: totals since start (prompt tokens actually computed).
        tokens_per_second: generated tokens per second over the last few seconds.
        kv_cache_usage: fraction of the KV-cache token capacity holding live keys/values.
        kv_slots_used / kv_slots_total: sequences in the cache / most at once.
        version: the weight version new tokens are sampled under.
        paused / asleep: generation paused; cache memory freed.
        finished: completed requests per finish reason.
    """

    running: int = 0
    waiting: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    tokens_per_second: float = 0.0
    kv_cache_usage: float = 0.0
    kv_slots_used: int = 0
    kv_slots_total: int = 0
    version: int = 0
    paused: bool = False
    asleep: bool = False
    finished: dict[str, int] = field(default_factory=dict)
