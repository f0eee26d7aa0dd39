"""Where an agent loop's model turns come from: a rollout engine in this process, or any
OpenAI-compatible server that takes token-id prompts and returns token ids (``tandem serve``;
vLLM with ``return_token_ids``). Both are asyncio-friendly: many episodes await turns at once.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Protocol

from tandem.protocol.generation import Completion, RolloutRequest, SamplingParams
from tandem.protocol.images import ImageInputs
from tandem.rollout.base import RolloutEngine


class TokenGenerator(Protocol):
    """Completes a token-id prompt (with a vision-language prompt's ``images``); the completion
    keeps the sampled ids, log-probs and versions."""

    async def generate(
        self,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        request_id: str,
        images: ImageInputs | None = None,
    ) -> Completion: ...


class EngineGenerator:
    """Turns from a :class:`~tandem.rollout.base.RolloutEngine` (native, HF or vLLM) in this process."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    async def generate(
        self,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        request_id: str,
        images: ImageInputs | None = None,
    ) -> Completion:
        future = self.engine.submit(RolloutRequest(request_id, tuple(prompt_ids), params, images))
        return await asyncio.wrap_future(future)


class ServerGenerator:
    """Turns from ``POST {base_url}/completions`` with the prompt as token ids.

    The reply's ``token_ids``, ``logprobs.token_logprobs`` and ``weight_versions`` (tandem's
    extensions, docs/serve.md) make the completion; a server that omits token ids is an error,
    since re-tokenising its text is what a trajectory must never need.
    """

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0, api_key: str = "") -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model, self.timeout_s, self.api_key = model, timeout_s, api_key

    async def generate(
        self,
        prompt_ids: tuple[int, ...],
        params: SamplingParams,
        request_id: str,
        images: ImageInputs | None = None,
    ) -> Completion:
        if images is not None:  # /completions takes token ids only; a chat request would re-render
            return Completion(
                request_id, prompt_ids, finish_reason="error",
                error=f"{self.url} takes token-id prompts without images: an episode with images needs "
                "the rollout engine in this process (leave agent.server_url unset)",
            )  # fmt: skip
        return await asyncio.to_thread(self._post, tuple(prompt_ids), params, request_id)

    def _post(self, prompt_ids: tuple[int, ...], params: SamplingParams, request_id: str) -> Completion:
        body = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "logprobs": 1,
            "logprobs_mode": params.logprobs_mode,
            "stop_token_ids": list(params.stop_token_ids),
        }
        if params.seed is not None:
            body["seed"] = int(params.seed) % 2**63
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                choice = json.loads(answer.read())["choices"][0]
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")[:300]
            return Completion(
                request_id, prompt_ids, finish_reason="error", error=f"HTTP {error.code}: {detail}"
            )
        except (OSError, ValueError, KeyError) as error:
            return Completion(request_id, prompt_ids, finish_reason="error", error=f"{self.url}: {error}")
        if "token_ids" not in choice:
            return Completion(
                request_id, prompt_ids, finish_reason="error",
                error=f"{self.url} returned no token_ids: an agent loop needs a server that returns them",
            )  # fmt: skip
        return Completion(
            request_id,
            prompt_ids,
            token_ids=list(choice["token_ids"]),
            log_probs=list(
                (choice.get("logprobs") or {}).get("token_logprobs") or [0.0] * len(choice["token_ids"])
            ),
            weight_versions=list(choice.get("weight_versions") or [0] * len(choice["token_ids"])),
            finish_reason=choice.get("finish_reason") or "stop",
        )
