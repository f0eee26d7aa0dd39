"""One packed forward of the native engine (:mod:`tandem.rollout.native`), and its head.

The packed row holds a step's computed prompts (prefill) followed by one token of each running
request (decode); the forward runs it through the lean decoder (Llama, Qwen2, Qwen3), a
vision-language model's language model over its prompts' image features, or HF's own decoder
with the slot KV cache plugged in. After it, the prompts other requests of the step share are
copied into their slots, and the head turns the last hidden states into fp32 logits, the same
computation the trainer runs. The decode steps of a CUDA graph skip this path
(:mod:`tandem.rollout.decode_graphs`)."""

from __future__ import annotations

import torch

from tandem.device import host_tensor
from tandem.kernels.cpu.linear import PackedLinears
from tandem.kernels.cuda.head import half_head_logits
from tandem.models.moe import RouterTap
from tandem.rollout.images import packed_vision_inputs
from tandem.rollout.kv_cache import SlotKVCache, StepPlan
from tandem.rollout.lean import LeanDecoder
from tandem.rollout.native_step import PrefillPlan, SequenceState
from tandem.rollout.shared_prefix import SharedPrefixes


class PackedForward:
    """The forward over one packed row, for one engine's model and KV cache.

    Args:
        model: the engine's model (on ``device``, its attention switched to the cache).
        cache: the engine's slot KV cache.
        device: the engine's device.
        vision: whether ``model`` is a vision-language model (HF's decoder on embeddings).
        lean: the lean forward, or None when the model runs HF's decoder.
        packed: the CPU's prepacked linear layers (empty elsewhere), for the head.
        routing: a mixture-of-experts model's router tap, or None.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache,
        device: torch.device,
        vision: bool,
        lean: LeanDecoder | None,
        packed: PackedLinears,
        routing: RouterTap | None,
    ) -> None:
        self.model, self.cache, self.device, self.vision = model, cache, device, vision
        self.lean, self.packed, self.routing = lean, packed, routing

    def run(
        self, prefill: PrefillPlan, decoding: list[SequenceState], shared: SharedPrefixes | None
    ) -> torch.Tensor:
        """The hidden states ``[T, H]`` of the packed row: ``prefill``'s prompts, then one token of
        each of ``decoding`` (``shared``: those grouped by a shared prompt, read once). An MoE
        model's experts of each token go to its request's ``routing``."""
        decode_ids = [s.completion.token_ids[-1] for s in decoding]
        decode_pos = [s.cached_len for s in decoding]
        plan = StepPlan(
            self.cache,
            tuple(segment for _, segment in prefill.segments),
            prefill.length,
            host_tensor(decode_pos, torch.long, self.device),
            shared,
        )
        input_ids = host_tensor([prefill.token_ids + decode_ids], torch.long, self.device)
        if self.vision:
            hidden = self._vision_forward(input_ids, prefill, decoding, plan)
        elif self.lean is not None:
            position_ids = host_tensor([prefill.positions + decode_pos], torch.long, self.device)
            hidden = self.lean(input_ids[0], position_ids[0], plan)
        else:
            position_ids = host_tensor([prefill.positions + decode_pos], torch.long, self.device)
            hidden = self.model.get_decoder()(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, tandem_plan=plan
            ).last_hidden_state[0]
        if self.routing is not None:
            self._record_routing(prefill, decoding)
        return hidden

    def _vision_forward(
        self,
        input_ids: torch.Tensor,
        prefill: PrefillPlan,
        decoding: list[SequenceState],
        plan: StepPlan,
    ) -> torch.Tensor:
        """A VLM's hidden states ``[T, H]`` of the packed row ``input_ids [1, T]``: the computed
        prompts' images through the vision tower, M-RoPE positions (a decode token at text
        position p sits at p + its request's delta), HF's language model over the cache."""
        prompts = [
            (segment.token_start, segment.token_end, sequence.request.images)
            for sequence, segment in prefill.segments
        ]
        rope = host_tensor([s.cached_len + s.rope_delta for s in decoding], torch.long, self.device)
        embeds, position_ids, deltas = packed_vision_inputs(self.model, input_ids, prompts, rope)
        for (sequence, _), delta in zip(prefill.segments, deltas, strict=True):
            sequence.rope_delta = delta
        return self.model.get_decoder()(
            inputs_embeds=embeds, position_ids=position_ids, use_cache=False, tandem_plan=plan
        ).last_hidden_state[0]

    def _record_routing(self, prefill: PrefillPlan, decoding: list[SequenceState]) -> None:
        """Each token's experts from this forward: a computed prompt's rows to its request, each
        decode row to its request."""
        routed = self.routing.recorded().cpu()  # [T, L, k] of the packed row
        for sequence, segment in prefill.segments:
            sequence.routing = [routed[segment.token_start : segment.token_end]]
        for index, sequence in enumerate(decoding):
            sequence.routing.append(routed[prefill.length + index : prefill.length + index + 1])

    def copy_prompts(self, prefill: PrefillPlan) -> None:
        """Give each request whose prompt another one computed in this step that prompt's keys,
        values and last hidden state."""
        if prefill.copies:
            self.cache.copy_slots(
                [source.slot for _, source in prefill.copies],
                [sequence.slot for sequence, _ in prefill.copies],
                max(len(sequence.prompt) for sequence, _ in prefill.copies),
            )
        for sequence, source in prefill.copies:
            prefill.hidden_rows[id(sequence)] = prefill.hidden_rows[id(source)]
            sequence.routing = list(source.routing)
            sequence.rope_delta = source.rope_delta

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The fp32 head's logits ``[B, V]`` of the last hidden states ``hidden [B, H]``, as in the
        trainer (half-precision inputs: their products, summed in fp32)."""
        head = self.model.get_output_embeddings()
        logits = half_head_logits(hidden, head.weight) if head.bias is None else None
        if logits is None:
            logits = self.packed.forward(head, hidden.float())  # [B, V]
        return logits


def last_hidden_states(
    prefill: PrefillPlan,
    admitted: list[SequenceState],
    decoding: list[SequenceState],
    hidden: torch.Tensor | None,
) -> torch.Tensor | None:
    """The batch's last hidden states ``[B, H]``: the admitted requests' prompt ends, then the
    decode rows in order (None when the step has neither)."""
    parts = [torch.stack([prefill.hidden_rows[id(s)] for s in admitted])] if admitted else []
    if decoding:
        assert hidden is not None  # decode rows always run the forward
        parts.append(hidden[prefill.length :])
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)
