"""The parts of one native-engine step: each request's state (and a refused request's completion),
the prefix cache's entries, the plan of a step's prefill, and when a sampled token ends a request
(:mod:`tandem.rollout.native`)."""

from __future__ import annotations

import collections
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tandem.protocol.generation import Completion, RolloutRequest, TokenCallback
from tandem.rollout.images import has_images
from tandem.rollout.kv_cache import PrefillSegment, SlotKVCache
from tandem.rollout.stats import EngineStats

STOP_STRING_WINDOW = 64  # the last tokens decoded to look for a stop string


@dataclass
class SequenceState:
    """One request inside the engine: its future, random stream, completion so far, what ends
    it, and where its keys and values are (its KV slot, how many tokens of it are cached)."""

    request: RolloutRequest
    future: Future
    seed: int
    completion: Completion
    stop_ids: frozenset[int]  # tokens that end it: its stop tokens, and EOS unless ignored
    token_limit: int  # most new tokens: max_tokens, or what fits in max_model_len
    on_token: TokenCallback | None = None
    slot: int = -1
    cached_len: int = 0  # tokens whose keys/values are in the cache
    prefill_version: int = -1  # the weight version its prompt's keys/values were computed under
    image_key: bytes | None = None  # its images' digest (tandem.rollout.images); None: no images
    rope_delta: int = 0  # M-RoPE: a token at text position p after the prompt sits at p + rope_delta
    routing: list[torch.Tensor] = field(
        default_factory=list
    )  # MoE: [n, L, k] chunks (tandem.rollout.routing)

    @property
    def prompt(self) -> tuple[int, ...]:
        """The prompt's token ids."""
        return self.request.prompt_ids

    @property
    def prefix_key(self) -> tuple[tuple[int, ...], bytes | None]:
        """What two requests must share to share the prompt's keys and values: its token ids and
        its images' digest."""
        return self.request.prompt_ids, self.image_key


@dataclass
class PrefixEntry:
    """A prompt's cached state under one weight version: its keys and values (one
    ``[kv_heads, prompt_len, head_dim]`` tensor per layer), its last hidden state ``[H]``, for an
    MoE model its tokens' experts ``[prompt_len, L, k]``, and for a VLM its M-RoPE delta."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    last_hidden: torch.Tensor
    routed_experts: torch.Tensor | None = None
    rope_delta: int = 0


# (weight version, prefix key: prompt ids and image digest) -> entry, oldest first
PrefixCache = collections.OrderedDict[tuple, PrefixEntry]


@dataclass
class PrefillPlan:
    """What a step's admitted requests need from its forward.

    Attributes:
        segments: the prompts computed in this step, each with its span of the packed row.
        token_ids / positions: the packed row's prefill part (the decode tokens follow it).
        copies: ``(request, source)``: a request whose prompt another request of this step
            computes; its slot gets a copy of the source's keys and values after the forward.
        hidden_rows: ``id(request)`` -> the prompt's last hidden state ``[H]``: filled here
            for prefix-cache hits, by the forward for the segments, then for the copies.
    """

    segments: list[tuple[SequenceState, PrefillSegment]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    copies: list[tuple[SequenceState, SequenceState]] = field(default_factory=list)
    hidden_rows: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def length(self) -> int:
        """Prompt tokens computed in this step (where the decode rows start in the packed row)."""
        return len(self.token_ids)


def plan_prefill(
    admitted: list[SequenceState],
    prefix: PrefixCache,
    version: int,
    cache: SlotKVCache,
    stats: EngineStats,
) -> PrefillPlan:
    """The prefill of the ``admitted`` requests: a prompt in the prefix cache (under ``version``)
    is written into the request's slot now (and counted a hit), a prompt already planned in this
    step is copied after the forward, any other is computed. "The same prompt" means the same
    token ids and the same images (:attr:`SequenceState.prefix_key`)."""
    plan = PrefillPlan()
    computing: dict[tuple, SequenceState] = {}
    for sequence in admitted:
        key = sequence.prefix_key
        entry = prefix.get((version, key))
        if entry is not None:
            prefix.move_to_end((version, key))
            cache.write(sequence.slot, entry.keys, entry.values)
            plan.hidden_rows[id(sequence)] = entry.last_hidden
            if entry.routed_experts is not None:
                sequence.routing = [entry.routed_experts]
            sequence.rope_delta = entry.rope_delta
            stats.prefix_hits += 1
        elif key in computing:  # same prompt as another request in this step
            plan.copies.append((sequence, computing[key]))
        else:
            computing[key] = sequence
            start = plan.length
            plan.segments.append(
                (sequence, PrefillSegment(start, start + len(sequence.prompt), sequence.slot))
            )
            plan.token_ids.extend(sequence.prompt)
            plan.positions.extend(range(len(sequence.prompt)))
        sequence.cached_len = len(sequence.prompt)
        sequence.prefill_version = version
    return plan


def new_sequence(
    request: RolloutRequest,
    future: Future,
    seed: int,
    eos_ids: frozenset[int],
    max_model_len: int,
    on_token: TokenCallback | None,
) -> SequenceState:
    """A valid request's state in the engine: its random stream ``seed``, what stops it (its stop
    tokens, and ``eos_ids`` unless it ignores EOS; its ``max_tokens``, or what fits in
    ``max_model_len``), and its images' digest (hashed here, off the engine's thread)."""
    params = request.params
    return SequenceState(
        request,
        future,
        seed,
        Completion(request.request_id, request.prompt_ids),
        frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_ids),
        min(params.max_tokens, max_model_len - len(request.prompt_ids)),
        on_token,
        image_key=request.images.digest if has_images(request) else None,
    )


def refused_completion(request: RolloutRequest, problem: str) -> Completion:
    """``request`` finished at once with ``error``: ``problem`` says why (images the model cannot take)."""
    return Completion(
        request.request_id,
        request.prompt_ids,
        finish_reason="error",
        error=f"request {request.request_id!r}: {problem}",
    )


def remember_prefix(
    prefix: PrefixCache,
    max_entries: int,
    version: int,
    cache: SlotKVCache,
    sequence: SequenceState,
    last_hidden: torch.Tensor,
) -> None:
    """Keep ``sequence``'s computed prompt in the prefix cache under weight ``version``: its keys and
    values read from its slot, its last hidden state ``[H]``, its experts and M-RoPE delta; the
    oldest entries go past ``max_entries`` (0: no prefix cache)."""
    if max_entries <= 0:
        return
    keys, values = cache.read(sequence.slot, len(sequence.prompt))
    routed = sequence.routing[0] if sequence.routing else None
    prefix[(version, sequence.prefix_key)] = PrefixEntry(
        keys, values, last_hidden.clone(), routed, sequence.rope_delta
    )
    while len(prefix) > max_entries:
        prefix.popitem(last=False)


def stop_reason(sequence: SequenceState, token: int, tokenizer) -> str | None:
    """Why ``token`` (just appended) ends ``sequence``: ``stop`` (a stop token, or a stop string
    in the decoded tail), ``length`` (its token limit), or None when it goes on."""
    if token in sequence.stop_ids:
        return "stop"
    stop = sequence.request.params.stop
    if stop:
        tail = tokenizer.decode(sequence.completion.token_ids[-STOP_STRING_WINDOW:])
        if any(s in tail for s in stop):
            return "stop"
    if len(sequence.completion.token_ids) >= sequence.token_limit:
        return "length"
    return None
