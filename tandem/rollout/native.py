"""The native rollout engine: continuous batching over a slot KV cache, exact processed log-probs.

Each :meth:`NativeRolloutEngine.step` runs ONE forward pass over a packed row holding the
prompts of newly admitted requests (prefill) followed by one token of every running
request (decode). New requests join at every step and finished ones leave at once. A
prompt shared by several requests (the n samples of a GRPO group) is computed once: its
keys/values and last hidden state go to a prefix cache keyed by (weight version, prompt,
images' digest) and are copied into the other requests' slots.

For Llama, Qwen2 and Qwen3 the forward runs through :class:`~tandem.rollout.lean.LeanDecoder`
(HF's computation without its per-layer Python overhead, bit-identical); other models use
HF's own decoder with the cache plugged in as an attention implementation (mixture-of-experts
models among them: the engine records each token's experts per MoE layer into the
completion's ``routed_experts``, :mod:`tandem.rollout.routing`; vision-language models, whose
language model HF's decoder runs on the packed row's embeddings with the prompts' image features
in place and M-RoPE positions, :mod:`tandem.rollout.images`). fp32 linear
layers run on oneDNN on the CPU (:mod:`tandem.kernels.cpu.linear`, as in the trainer), with
weights prepacked into oneDNN's blocked layout for the lean forward and the head. On a GPU
the model, the KV cache and the sampler's tensors live on the engine's device
(:mod:`tandem.device`) and PyTorch's own kernels run.

The output head runs in fp32 (``hidden.float() @ W.float().T``), the same computation the
trainer uses, and each token's log-probability comes from the distribution it was drawn
from. Every token records the weight version it was sampled under; prefix-cache entries
of an older version are never used (they are dropped on every weight update).

Threading: one background thread runs steps; the public methods are thread-safe and the
async ones (:meth:`generate`) integrate with asyncio.

The engine's config is :mod:`tandem.rollout.native_config`; the parts of a step (each request's
state, the prefill plan, the stop rule) are :mod:`tandem.rollout.native_step`; the packed forward
and the head are :mod:`tandem.rollout.native_forward`. This module schedules: it admits, steps,
samples and retires requests, and owns the prefix cache and the engine's controls.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future

import torch

from tandem.config.validation import check_choice
from tandem.device import bind_device, host_tensor, uses_cpu_kernels, uses_cuda_graphs
from tandem.kernels.cpu import enable_cpu_kernels
from tandem.kernels.cpu.linear import PackedLinears
from tandem.models.loading import load_model, load_tokenizer, resolve_dtype
from tandem.models.moe import RouterTap, is_moe
from tandem.models.stop_ids import end_of_sequence_ids
from tandem.models.vision import is_vision_language
from tandem.protocol.generation import (
    Completion,
    EngineMetrics,
    RolloutRequest,
    TokenCallback,
    prompt_problem,
)
from tandem.rollout.decode_graphs import DecodeGraphs
from tandem.rollout.images import image_request_problem
from tandem.rollout.kv_budget import engine_kv_plan
from tandem.rollout.kv_cache import KV_ATTENTION, SlotKVCache
from tandem.rollout.lean import LeanDecoder, lean_unsupported_reason
from tandem.rollout.native_config import PAUSE_MODES, NativeEngineConfig
from tandem.rollout.native_forward import PackedForward, last_hidden_states
from tandem.rollout.native_step import (
    PrefillPlan,
    PrefixCache,
    SequenceState,
    new_sequence,
    plan_prefill,
    refused_completion,
    remember_prefix,
    stop_reason,
)
from tandem.rollout.routing import completed_routing
from tandem.rollout.sampling import draw_step
from tandem.rollout.shared_prefix import SharedPrefixes, group_by_prefix
from tandem.rollout.shared_weights import load_unshared, share_named_tensors
from tandem.rollout.stats import EngineStats


class NativeRolloutEngine:
    """Continuous-batching generation for HF decoder-only models (see the module docstring).

    A vision-language model (Qwen2-VL, Qwen2.5-VL) takes requests with images; it always runs
    HF's decoder (never the lean forward) and so never CUDA graphs, whose decode steps have no
    room for each request's M-RoPE offset. A request with images for a text-only model, or whose
    image tokens do not match its images, finishes at once with ``error`` and a message saying why.

    Args:
        model: an HF causal LM or image-text-to-text model (its language model's attention
            implementation is switched to ``tandem_kv``).
        tokenizer: its tokenizer (EOS and stop strings).
        config: sizes and limits.
    """

    generates_in_background = True  # the step loop, on a thread of its own

    def __init__(self, model: torch.nn.Module, tokenizer, config: NativeEngineConfig | None = None) -> None:
        self.config = config or NativeEngineConfig()
        self.device = bind_device(self.config.device)
        self.model = model.to(device=self.device, dtype=resolve_dtype(self.config.dtype)).eval()
        enable_cpu_kernels(self.model, self.device)  # the trainer's linear kernels, on the CPU only
        self.vision = is_vision_language(self.model)
        # A VLM's vision tower keeps its own attention: the cache is the language model's.
        self.model.set_attn_implementation({"text_config": KV_ATTENTION} if self.vision else KV_ATTENTION)
        lean = self.config.lean_forward and not self.vision and lean_unsupported_reason(self.model) is None
        self._packed = PackedLinears(
            self.model, enabled=self.config.prepack_weights and uses_cpu_kernels(self.device)
        )
        self._lean = LeanDecoder(self.model, self._packed) if lean else None
        self._routing = RouterTap(self.model) if is_moe(self.model) else None  # MoE: records experts
        self.tokenizer = tokenizer
        hf = self.model.config.get_text_config()
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.eos_ids = end_of_sequence_ids(self.model, tokenizer)  # config, generation config, tokenizer
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        self.kv_plan = engine_kv_plan(self.config, hf, head_dim, self.device)  # refuses what cannot fit
        self.max_num_seqs = self.kv_plan.num_slots  # the config's, or what fits when it is unset
        self.cache = SlotKVCache(
            hf.num_hidden_layers,
            self.max_num_seqs,
            hf.num_key_value_heads,
            self.config.max_model_len,
            head_dim,
            resolve_dtype(self.config.dtype),
            self.device,
        )
        graphs = (
            self.config.cuda_graphs
            and uses_cuda_graphs(self.device)
            and self._lean is not None
            and self._lean.rotary.cacheable
        )
        self.decode_graphs = DecodeGraphs(self._lean, self.cache) if graphs else None
        self._packed_forward = PackedForward(
            self.model, self.cache, self.device, self.vision, self._lean, self._packed, self._routing
        )
        self.version = 0
        self.stats = EngineStats()
        self._waiting: collections.deque[SequenceState] = collections.deque()
        self._running: list[SequenceState] = []  # index == KV slot
        self._batch_epoch = 0  # bumped whenever the running set or its slots change
        self._sharing: tuple[tuple[int, int], SharedPrefixes | None] = ((-1, 0), None)  # ((epoch, D), groups)
        self._prefix: PrefixCache = collections.OrderedDict()
        self._seed_counter = itertools.count()
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._paused = False
        self._draining = False  # pause('wait'): finish running requests, admit none
        self._asleep = False
        self._packs_stale = False  # the prepacked copies were released: rebuilt before the next step
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def lean_decoder(self) -> LeanDecoder | None:
        """The lean forward the engine runs, or ``None`` when the model needs HF's."""
        return self._lean

    @property
    def prepacked_weights(self) -> int:
        """How many prepacked weight copies the engine holds now (0 while they are released)."""
        return len(self._packed)

    @staticmethod
    def from_pretrained(path: str, config: NativeEngineConfig | None = None) -> NativeRolloutEngine:
        """An engine over the HF model and tokenizer saved in ``path``."""
        config = config or NativeEngineConfig()
        return NativeRolloutEngine(load_model(path, config.dtype), load_tokenizer(path), config)

    # ------------------------------------------------------------------ requests
    def submit(
        self, request: RolloutRequest, *, start_loop: bool = True, on_token: TokenCallback | None = None
    ) -> Future:
        """Queue ``request``; the future resolves to its :class:`Completion`.

        ``on_token(token_id, log_prob, version)`` runs on the engine thread after every token
        (streaming); keep it short and never call back into the engine from it (one that
        raises ends its own request with ``error``). A bad request (empty or over-long prompt,
        unknown token ids, a duplicate id) fails its own future with ``ValueError``; images the
        model cannot take finish the request with ``error`` and the reason. The engine keeps
        serving the others.
        """
        future: Future = Future()
        problem = self._validate(request)
        if problem:
            future.set_exception(ValueError(f"request {request.request_id!r}: {problem}"))
            return future
        problem = image_request_problem(request, self.model.config)
        if problem:
            with self._lock:
                self.stats.finished["error"] += 1
            future.set_result(refused_completion(request, problem))
            return future
        params = request.params
        seed = (
            params.seed
            if params.seed is not None
            else self.config.seed * 1_000_003 + next(self._seed_counter)
        )
        sequence = new_sequence(request, future, seed, self.eos_ids, self.config.max_model_len, on_token)
        with self._lock:
            if any(
                s.request.request_id == request.request_id
                for s in itertools.chain(self._waiting, self._running)
            ):
                future.set_exception(
                    ValueError(f"request {request.request_id!r}: this id is already in flight")
                )
                return future
            self._waiting.append(sequence)
            if start_loop:
                self._ensure_thread()
            self._wake.notify_all()
        return future

    def _validate(self, request: RolloutRequest) -> str | None:
        return prompt_problem(request.prompt_ids, self.config.max_model_len, self.vocab_size)

    async def generate(self, request: RolloutRequest) -> Completion:
        """Generate one response (asyncio)."""
        return await asyncio.wrap_future(self.submit(request))

    def generate_batch(
        self, requests: Iterable[RolloutRequest], timeout: float | None = None
    ) -> list[Completion]:
        """Submit all requests and wait for every completion, in request order.

        When no background loop is running, the steps run on the calling thread: compute then
        stays on one thread (one OpenMP team on CPU), which is what a synchronous trainer wants.
        """
        if self._thread is not None and self._thread.is_alive():
            futures = [self.submit(r) for r in requests]
            return [f.result(timeout=timeout) for f in futures]
        futures = [self.submit(r, start_loop=False) for r in requests]
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(f.done() for f in futures):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"generate_batch did not finish within {timeout} s")
            with self._lock:
                if self._paused or self._asleep:
                    raise RuntimeError(
                        "generate_batch cannot make progress while the engine is paused or asleep"
                    )
                self._step_or_fail()
        return [f.result() for f in futures]

    def abort(self, request_id: str) -> bool:
        """Finish ``request_id`` now with reason ``abort`` (tokens so far are kept); False if unknown."""
        with self._lock:
            for sequence in list(self._waiting):
                if sequence.request.request_id == request_id:
                    self._waiting.remove(sequence)
                    self._finish(sequence, "abort")
                    return True
            for sequence in self._running:
                if sequence.request.request_id == request_id:
                    self._release(sequence, "abort")
                    return True
        return False

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def metrics(self) -> EngineMetrics:
        """A snapshot for monitoring: queue sizes, throughput, KV-cache use, weight version."""
        with self._lock:
            cached = sum(s.cached_len for s in self._running)
            capacity = self.max_num_seqs * self.config.max_model_len
            return EngineMetrics(
                running=len(self._running),
                waiting=len(self._waiting),
                generated_tokens=self.stats.generated_tokens,
                prompt_tokens=self.stats.prefilled_tokens,
                tokens_per_second=self.stats.tokens_per_second(time.monotonic()),
                kv_cache_usage=0.0 if self._asleep else cached / capacity,
                kv_slots_used=len(self._running),
                kv_slots_total=self.max_num_seqs,
                version=self.version,
                paused=self._paused,
                asleep=self._asleep,
                finished=dict(self.stats.finished),
            )

    # ------------------------------------------------------------------ control
    def pause(self, mode: str = "keep") -> None:
        """Stop generating. ``keep``: in-flight requests stay and continue after :meth:`resume`;
        ``abort``: they finish now with reason ``abort``; ``wait``: stop admitting and return once
        the running ones have finished. Queued requests stay queued in every mode."""
        check_choice("pause", "mode", mode, PAUSE_MODES)
        with self._lock:
            if mode == "abort":
                for sequence in list(self._running):
                    self._release(sequence, "abort")
            if mode == "wait":
                self._draining = True
                while self._running and not self._closed:
                    self._wake.wait(timeout=0.05)
                self._draining = False
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._paused = False
            self._wake.notify_all()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Load new weights (HF names) while paused or idle; later tokens carry ``version``.

        Returns the number of tensors loaded. The prefix cache is emptied: no entry computed
        under the old weights can be reused.
        """
        with self._lock:
            if self._running and not self._paused:
                raise RuntimeError("update_weights needs the engine paused (pause()) or idle")
            if version <= self.version:
                raise ValueError(f"weight version must increase: got {version}, current {self.version}")
            loaded = load_unshared(self.model, named_tensors)  # a tensor it shares is in place already
            self._repack()
            self.version = version
            self._prefix.clear()
            return loaded

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Make the model's parameters the given tensors themselves where shape, dtype and device
        match, copying the others in (:mod:`tandem.rollout.shared_weights`); returns how many are shared.

        For colocated sync training: the trainer's optimizer then updates the engine's weights in
        place, and :meth:`update_weights` only has to bump the version, empty the prefix cache and
        re-pack. Only safe while nothing generates during the trainer's update (the sync pipeline's
        order); needs the engine paused or idle.
        """
        with self._lock:
            if self._running and not self._paused:
                raise RuntimeError("share_weights needs the engine paused (pause()) or idle")
            shared = share_named_tensors(self.model, named_tensors)
            self._repack()
            self._prefix.clear()
            return shared

    def release_packed_weights(self) -> None:
        """Drop the prepacked inference copies of the weights (``prepack_weights``: one more copy of
        the linear weights) until the engine needs them: the next step or weight update packs them
        again, once. Colocated training calls it after each generation, so the update has that memory."""
        with self._lock:
            if self._packed.enabled and len(self._packed):
                self._packed.release()
                self._packs_stale = True

    def _repack(self) -> None:
        """Pack the weights now, or at the next step when the engine is asleep (the packs are
        released while it sleeps)."""
        if self._asleep:
            self._packs_stale = self._packed.enabled
            return
        self._packed.refresh()
        self._packs_stale = False

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self._prefix.clear()

    def sleep(self) -> None:
        """Free the KV cache, the prefix cache and the prepacked weights (colocated training needs the
        memory); needs no running request."""
        with self._lock:
            if self._running:
                raise RuntimeError(
                    f"sleep needs no running requests ({len(self._running)} are); pause(mode='abort' or 'wait') first"
                )
            self.cache.free()
            if self.decode_graphs is not None:
                self.decode_graphs.clear()  # they write the freed cache
            self._prefix.clear()
            self._asleep = True
        self.release_packed_weights()

    def wake(self) -> None:
        with self._lock:
            if self._asleep:
                self.cache.allocate()
                self._asleep = False
                self._wake.notify_all()

    def close(self) -> None:
        """Stop the background thread; pending requests are aborted."""
        with self._lock:
            self._closed = True
            for sequence in list(self._running):
                self._release(sequence, "abort")
            while self._waiting:
                self._finish(self._waiting.popleft(), "abort")
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the loop
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="tandem-rollout", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                if self._paused or self._asleep or not (self._running or self._waiting):
                    self._wake.wait(timeout=0.5)
                    continue
                self._step_or_fail()
                self._wake.notify_all()
            time.sleep(0)  # let API callers take the lock between steps

    def _step_or_fail(self) -> None:
        try:
            self.step()
        except Exception as error:  # a broken step fails its requests, never the loop silently
            for sequence in list(self._running):
                self._release(sequence, "error", f"{type(error).__name__}: {error}")

    @torch.inference_mode()
    def step(self) -> None:
        """Admit what fits, run one packed forward (prefill + decode), sample, retire finished requests."""
        if self._packs_stale:  # released after the last generation (colocated training)
            self._packed.refresh()
            self._packs_stale = False
        decoding = list(self._running)
        admitted = [] if self._draining else self._admit()
        prefill = plan_prefill(admitted, self._prefix, self.version, self.cache, self.stats)
        hidden = self._forward(prefill, decoding, graphs_allowed=not admitted)
        for sequence in decoding:  # each wrote its decode token's keys and values
            sequence.cached_len += 1
        self._packed_forward.copy_prompts(prefill)
        last_hidden = last_hidden_states(prefill, admitted, decoding, hidden)
        if last_hidden is not None:
            self._sample_and_append(admitted + decoding, last_hidden)
        self.stats.steps += 1

    def _forward(
        self, prefill: PrefillPlan, decoding: list[SequenceState], graphs_allowed: bool
    ) -> torch.Tensor | None:
        """The hidden states ``[T, H]`` of one packed row, ``prefill``'s prompts then one token of
        each of ``decoding``; None when there is nothing to compute. Each computed prompt's last
        hidden state goes to ``prefill.hidden_rows`` and the prefix cache."""
        decode_ids = [s.completion.token_ids[-1] for s in decoding]
        decode_pos = [s.cached_len for s in decoding]
        if not prefill.token_ids and not decode_ids:
            return None
        # A graph pads the decode rows into the slots after them, so none may be newly filled
        # (a request admitted from the prefix cache holds one without a prefill).
        if graphs_allowed and self.decode_graphs is not None:
            hidden = self.decode_graphs.run(
                host_tensor(decode_ids, torch.long, self.device),
                host_tensor(decode_pos, torch.long, self.device),
                max(decode_pos) + 1,
            )
            self.stats.graph_steps += 1
            return hidden
        shared = self._shared_prefixes(decoding) if decoding else None
        hidden = self._packed_forward.run(prefill, decoding, shared)
        for sequence, segment in prefill.segments:
            prefill.hidden_rows[id(sequence)] = hidden[segment.token_end - 1]
            remember_prefix(
                self._prefix, self.config.prefix_cache_entries, self.version, self.cache, sequence,
                hidden[segment.token_end - 1],
            )  # fmt: skip
        self.stats.prefilled_tokens += prefill.length
        return hidden

    def _shared_prefixes(self, decoding: list[SequenceState]) -> SharedPrefixes | None:
        """The decode tokens grouped by shared prompt (same prompt and images, same weight
        version), when reading each prompt once pays; recomputed only after the running set changed."""
        if not self.config.share_prefix_reads:
            return None
        built_for, shared = self._sharing
        if built_for != (self._batch_epoch, len(decoding)):
            keys = [(s.prefill_version, s.prefix_key) for s in decoding]
            # each sequence's own tokens over the rest of its decode: from what it has to its limit
            own = sum(len(s.completion.token_ids) + s.token_limit for s in decoding) / (2 * len(decoding))
            shared = group_by_prefix(keys, [len(s.prompt) for s in decoding], own)
            if shared is not None and self.device.type != "cpu":
                shared = shared.to(self.device)
            self._sharing = ((self._batch_epoch, len(decoding)), shared)
        if shared is not None:
            self.stats.shared_prefix_steps += 1
        return shared

    def _admit(self) -> list[SequenceState]:
        admitted, prompt_tokens = [], 0
        while self._waiting and len(self._running) < self.max_num_seqs:
            sequence = self._waiting[0]
            if admitted and prompt_tokens + len(sequence.prompt) > self.config.max_prefill_tokens:
                break
            self._waiting.popleft()
            sequence.slot = len(self._running)
            self._running.append(sequence)
            admitted.append(sequence)
            prompt_tokens += len(sequence.prompt)
        if admitted:
            self._batch_epoch += 1
        return admitted

    def _sample_and_append(self, batch: list[SequenceState], hidden: torch.Tensor) -> None:
        """Draw each request's next token from the fp32 head's logits of its last hidden state
        (``hidden [B, H]``, in ``batch``'s order), append it with its log-prob and the weight
        version, tell its listener, and retire the requests it ends."""
        draws = draw_step(
            self._packed_forward.head_logits(hidden),
            [s.request.params for s in batch],
            [s.seed for s in batch],
            [len(s.completion.token_ids) for s in batch],
        )
        for sequence, token, log_prob in zip(batch, draws.tokens, draws.log_probs, strict=True):
            completion = sequence.completion
            completion.token_ids.append(token)
            completion.log_probs.append(log_prob)
            completion.weight_versions.append(self.version)
            if sequence.on_token is not None:
                try:
                    sequence.on_token(token, completion.log_probs[-1], self.version)
                except Exception as error:  # a broken listener ends its own request only
                    self._release(sequence, "error", f"on_token callback failed: {error!r}")
                    continue
            reason = stop_reason(sequence, token, self.tokenizer)
            if reason:
                self._release(sequence, reason)
        self.stats.record_step(len(batch), time.monotonic())

    def _release(self, sequence: SequenceState, reason: str, error: str | None = None) -> None:
        """Retire a running sequence and keep slots compact: the last slot moves into the freed one."""
        slot = sequence.slot
        self._batch_epoch += 1
        last = self._running.pop()
        if last is not sequence:
            self.cache.move(last.slot, slot, last.cached_len)
            last.slot = slot
            self._running[slot] = last
        self._finish(sequence, reason, error)

    def _finish(self, sequence: SequenceState, reason: str, error: str | None = None) -> None:
        if self._routing is not None:
            completion = sequence.completion
            completion.routed_experts = completed_routing(
                sequence.routing,
                len(completion.prompt_ids) + len(completion.token_ids),
                self._routing.num_layers,
                self._routing.top_k,
            )
        sequence.completion.finish_reason = reason
        sequence.completion.error = error
        self.stats.finished[reason] += 1
        if not sequence.future.done():
            sequence.future.set_result(sequence.completion)
