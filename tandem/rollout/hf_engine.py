"""The ``hf`` reference engine: transformers' ``generate``, one request at a time. Slow, simple, the oracle.

For a mixture-of-experts model it records each token's experts per MoE layer (each decoder
forward of ``generate`` routes the tokens it feeds in) into the completion's ``routed_experts``.
A vision-language model gets the request's images (``pixel_values``, ``image_grid_thw`` and the
image tokens' ``mm_token_type_ids``); images the model cannot take finish the request with
``error`` (:func:`~tandem.rollout.images.image_request_problem`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from concurrent.futures import Future

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.utils import GenerateDecoderOnlyOutput

from tandem.device import bind_device
from tandem.models.loading import load_model, load_tokenizer
from tandem.models.moe import RouterTap, is_moe
from tandem.models.stop_ids import end_of_sequence_ids
from tandem.models.vision import image_token_id, is_vision_language
from tandem.models.weights import load_named_tensors
from tandem.protocol.generation import (
    Completion,
    EngineMetrics,
    RolloutRequest,
    SamplingParams,
    TokenCallback,
)
from tandem.rollout.images import has_images, image_request_problem
from tandem.rollout.routing import completed_routing


def sampling_warpers(params: SamplingParams) -> LogitsProcessorList:
    """The logits warpers ``generate`` samples through: temperature, then top-k and top-p when they
    restrict anything (none for greedy decoding)."""
    warpers = LogitsProcessorList()
    if not params.greedy:
        warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k:
            warpers.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1:
            warpers.append(TopPLogitsWarper(params.top_p))
    return warpers


class HFRolloutEngine:
    """Generates with ``model.generate`` per request (no batching, no KV sharing, no prefix cache).

    It implements the same request API as the native engine so tests can compare them;
    pause/sleep have nothing to hold or free and only track state.
    """

    generates_in_background = False  # submit() generates the whole response on the calling thread

    def __init__(self, model: torch.nn.Module, tokenizer) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.eos_ids = end_of_sequence_ids(model, tokenizer)  # config, generation config, tokenizer
        self.version = 0
        self.paused = False
        self.generated_tokens = 0
        self._routing = RouterTap(model) if is_moe(model) else None
        self._routed: list[torch.Tensor] = []  # this request's [n, L, k] per decoder forward
        if self._routing is not None:
            model.get_decoder().register_forward_hook(self._record_routing)

    def _record_routing(self, module: torch.nn.Module, args: tuple, output: object) -> None:
        self._routed.append(self._routing.recorded().cpu())

    @property
    def max_model_len(self) -> int:
        return self.model.config.get_text_config().max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @staticmethod
    def from_pretrained(path: str, dtype: str = "float32", device: str = "auto") -> HFRolloutEngine:
        """The engine over the HF model in ``path``, placed on ``device`` (see :mod:`tandem.device`)."""
        model = load_model(path, dtype, attn_implementation="eager").to(bind_device(device))
        return HFRolloutEngine(model, load_tokenizer(path))

    def submit(self, request: RolloutRequest, *, on_token: TokenCallback | None = None) -> Future:
        """Generate now, on the calling thread; ``on_token`` sees the tokens once generation ends."""
        future: Future = Future()
        try:
            completion = self._generate(request)
        except Exception as error:
            future.set_exception(error)
            return future
        if on_token is not None:
            for token, log_prob, version in zip(
                completion.token_ids, completion.log_probs, completion.weight_versions, strict=True
            ):
                on_token(token, log_prob, version)
        self.generated_tokens += len(completion.token_ids)
        future.set_result(completion)
        return future

    async def generate(self, request: RolloutRequest) -> Completion:
        return await asyncio.wrap_future(self.submit(request))

    def generate_batch(
        self, requests: Iterable[RolloutRequest], timeout: float | None = None
    ) -> list[Completion]:
        return [self.submit(r).result(timeout=timeout) for r in requests]

    @torch.inference_mode()
    def _generate(self, request: RolloutRequest) -> Completion:
        params = request.params
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        problem = image_request_problem(request, self.model.config, exact=True)
        if problem:
            message = f"request {request.request_id!r}: {problem}"
            return Completion(request.request_id, request.prompt_ids, finish_reason="error", error=message)
        eos = [] if params.ignore_eos else sorted(self.eos_ids)
        stop_ids = list(params.stop_token_ids) + eos
        self._routed = []
        output = self._seeded_generate(request, stop_ids)
        tokens = output.sequences[0, len(request.prompt_ids) :].tolist()
        scores = output.scores if params.logprobs_mode == "processed" else output.logits
        log_probs = [
            float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(scores, tokens, strict=False)
        ]
        finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
        routed = None
        if self._routing is not None:
            routed = completed_routing(
                self._routed,
                len(request.prompt_ids) + len(tokens),
                self._routing.num_layers,
                self._routing.top_k,
            )
        return Completion(
            request.request_id,
            request.prompt_ids,
            tokens,
            log_probs,
            [self.version] * len(tokens),
            finish,
            routed_experts=routed,
        )

    def _seeded_generate(self, request: RolloutRequest, stop_ids: list[int]) -> GenerateDecoderOnlyOutput:
        """``model.generate``'s output (sequences, processed scores and raw logits per step) for one
        request, sampled with the request's seed without disturbing the process's RNGs (CPU and CUDA)."""
        params = request.params
        cuda = []
        if self.device.type == "cuda":
            cuda = [torch.cuda.current_device() if self.device.index is None else self.device.index]
        with torch.random.fork_rng(devices=cuda):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            input_ids = torch.tensor([request.prompt_ids], device=self.device)
            return self.model.generate(
                input_ids,
                attention_mask=torch.ones(1, len(request.prompt_ids), dtype=torch.long, device=self.device),
                **self._image_inputs(request, input_ids),
                do_sample=not params.greedy,
                max_new_tokens=params.max_tokens,
                eos_token_id=stop_ids or None,
                pad_token_id=self.tokenizer.pad_token_id,
                logits_processor=sampling_warpers(params),
                output_scores=True,
                output_logits=True,
                return_dict_in_generate=True,
                temperature=None,
                top_k=None,
                top_p=None,
            )

    def _image_inputs(self, request: RolloutRequest, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """``generate``'s image arguments for a VLM's request (none for a text model)."""
        if not is_vision_language(self.model):
            return {}
        token_types = (input_ids == image_token_id(self.model.config)).to(torch.int32)
        if not has_images(request):
            return {"mm_token_type_ids": token_types}
        images = request.images.to(self.device)
        return {
            "pixel_values": images.pixel_values,
            "image_grid_thw": images.image_grid_thw,
            "mm_token_type_ids": token_types,
        }

    def abort(self, request_id: str) -> bool:
        return False  # requests finish inside submit(); nothing is ever in flight

    def pause(self, mode: str = "keep") -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        loaded = load_named_tensors(self.model, named_tensors)
        self.version = version
        return loaded

    def sleep(self) -> None:
        """Nothing to free: generate allocates its cache per call."""

    def wake(self) -> None:
        """Nothing to restore."""

    def reset_prefix_cache(self) -> None:
        """No prefix cache to reset."""

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(generated_tokens=self.generated_tokens, version=self.version, paused=self.paused)

    def close(self) -> None:
        """Nothing runs in the background."""
