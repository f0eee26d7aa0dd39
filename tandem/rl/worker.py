"""``ActorRolloutRefWorker``: the actor, rollout and reference roles colocated in one process per rank.

The "hybrid engine": each rank binds its device (:mod:`tandem.device`), trains its shard of
the batch with the torch engine (DDP/FSDP2 across ranks), generates its shard with the
configured rollout engine (``rollout.engine.name``), and syncs weights from the trainer into
its own rollout engine in process: a native engine holds the actor's own parameter tensors
(one copy of the weights; the sync only re-packs), another engine gets a copy.
``actor.offload.*`` keeps the actor's parameters and optimizer state, and the reference, on
the CPU while the phases at hand do not read them (:mod:`tandem.engine.offload`). The controller (:mod:`tandem.rl.trainer`) calls
these methods; ``@register`` declares how batches are split over ranks and collected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterator

import torch

from tandem.agents.rollout import AgentRollout
from tandem.checkpoint_engine.roles import SendsWeights
from tandem.controller import Worker, mesh_dispatch, register
from tandem.controller.profiling import ProfilesCalls
from tandem.dataplane import BatchRef
from tandem.device import max_memory_allocated_gb, release_cached_memory, reset_peak_memory
from tandem.dpo.loss import preference_loss
from tandem.engine import TorchTrainEngine
from tandem.engine.base import GATHER_FIELD
from tandem.engine.divergence import ModelHealth, SkippedUpdates
from tandem.engine.forward_fields import FORWARD_FIELDS
from tandem.engine.offload import Residency
from tandem.engine.on_rank import bind_rank, frozen_copy, parameter_count, parked, start_engine
from tandem.engine.vision_inputs import stored_image_layout
from tandem.models.loading import check_vocab_compatible, load_tokenizer
from tandem.models.vision import ImagePrompter
from tandem.pipeline.requests import rollout_requests, with_completions
from tandem.pipeline.stored_rollout import RESPONSE_TEXT, store_rollout
from tandem.protocol import Batch
from tandem.protocol.generation import raise_failed_requests
from tandem.protocol.sequences import decode_sampled, response_part
from tandem.rl.actor_loss import make_actor_loss
from tandem.rl.config import TrainConfig
from tandem.rl.data.prompt_rows import RankPrompts
from tandem.rl.dataset_step_worker import DatasetStepRanks
from tandem.rl.derived import actor_engine_config, rollout_engine_config
from tandem.rl.metric_shares import MEAN_PREFIXES, reduce_metric
from tandem.rl.preference_pairs import with_pair_fields
from tandem.rl.rank_advantages import PART_READS as ADVANTAGE_PART_READS
from tandem.rl.rank_advantages import advantage_part
from tandem.rollout import SamplingParams
from tandem.rollout.factory import build_rollout_engine
from tandem.rollout.native import NativeRolloutEngine
from tandem.seeds import derive_seed

ACTOR_MESH = "actor"  # the engine's data-parallel ranks: sequence/tensor-parallel peers get the same rows
ACTOR_UPDATE_FIELDS = (
    *FORWARD_FIELDS,
    "response_mask",
    "old_log_probs",
    "advantages",
    "rollout_is_weights",
    "rollout_log_probs",
    "ref_log_probs",
    "teacher_top_ids",
    "teacher_top_log_probs",
    "loss_mask",
    "chosen",
    "pair",
)  # what update_actor and its losses read (a BatchRef argument fetches only these)
SHUFFLE_SEED_TAG = 101  # derive_seed(run seed, this, step, epoch): the mini-batch order of an epoch


class ActorRolloutRefWorker(DatasetStepRanks, SendsWeights, ProfilesCalls, Worker):
    """One rank of the colocated actor + rollout + reference group (see the module docstring).

    With an asynchronous pipeline (``pipeline.mode`` other than ``sync``) the rollout lives on
    replicas of its own: this worker builds no rollout engine and sends its weights through
    the checkpoint engine (:class:`SendsWeights`).
    """

    def __init__(self, config: TrainConfig) -> None:
        self.config = config

    # ------------------------------------------------------------------ set-up
    @register(dispatch="ONE_TO_ALL")
    def init_model(self, schedule_steps: int) -> int:
        """Bind this rank's device, load the policy into the trainer and the rollout engine (and
        the reference); returns the parameter count. ``schedule_steps`` is the learning-rate
        schedule's length over the run (unless ``actor.engine.total_steps`` is set)."""
        config = self.config
        self.device = bind_rank(self, config.trainer.device)
        if config.pipeline.trainer_threads and self.device.type == "cpu":
            torch.set_num_threads(config.pipeline.trainer_threads)
        self._peaks: dict[str, float] = {}
        self.tokenizer = load_tokenizer(config.model_path)
        self.prompt_rows = RankPrompts.of_config(config.data, self.tokenizer, config.model_path)  # by place
        self.engine = start_engine(
            self,
            actor_engine_config(config, str(self.device), config.actor.engine.strategy, schedule_steps),
            mesh=ACTOR_MESH,
        )
        check_vocab_compatible(self.engine.causal_lm, self.tokenizer)
        self.skipped = SkippedUpdates(
            config.trainer.max_skipped_updates_in_a_row, "trainer.max_skipped_updates_in_a_row"
        )
        self._probe: Batch | None = None
        self.rollout = None
        self.agents: AgentRollout | None = None
        if not config.pipeline.disaggregated:
            self.rollout = build_rollout_engine(
                rollout_engine_config(config, str(self.device)), config.model_path
            )
            if config.agent.enabled:
                prompter = ImagePrompter.for_model(config.model_path)
                self.agents = AgentRollout(config.agent, self.tokenizer, self.rollout, prompter)
        self.reference: TorchTrainEngine | None = None
        if config.needs_reference and not config.actor.engine.lora.rank:
            # A frozen copy computing log-probs only: sharded like the actor under FSDP2; a whole copy
            # per rank otherwise (each rank scores its own rows, so DDP would add nothing).
            engine_config = self.engine.config
            reference_strategy = "fsdp2" if engine_config.strategy == "fsdp2" else "single"
            self.reference = frozen_copy(dataclasses.replace(engine_config, strategy=reference_strategy))
        offload = config.actor.offload
        self.actor_residency = Residency(self.engine, self.device, offload.params, offload.optimizer)
        self.reference_residency = (  # waits on the CPU between its log-prob passes
            parked(self.reference, offload.reference) if self.reference is not None else None
        )
        self._share_rollout_weights()
        return parameter_count(self.engine)

    def _share_rollout_weights(self) -> None:
        """One copy of the policy's weights, not two: a native rollout engine in this process takes
        the actor's parameter tensors as its own (the optimizer's in-place step updates both; the
        weight sync only re-packs). Not when the actor's parameters move off the device between
        phases (``actor.offload.params`` on an accelerator): the engine generates while they are away."""
        if isinstance(self.rollout, NativeRolloutEngine) and not self.actor_residency.offloads_params:
            self.rollout.share_weights(self.engine.iter_parameters())

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        """Measure the peak GPU memory of one phase of the step (nothing is measured on the CPU)."""
        reset_peak_memory(self.device)
        yield
        peak = max_memory_allocated_gb(self.device)
        if peak is not None:
            self._peaks[f"perf/max_memory_allocated_gb/{name}"] = peak

    @register(dispatch="ONE_TO_ALL")
    def memory_metrics(self) -> dict[str, float]:
        """``perf/max_memory_allocated_gb/<phase>`` of each phase since the last call (empty on the CPU)."""
        peaks, self._peaks = self._peaks, {}
        return peaks

    # ------------------------------------------------------------------ generation
    @register(dispatch="DP_COMPUTE")
    def generate_sequences(self, prompts: Batch, *, sampling: SamplingParams, prompt_width: int) -> Batch:
        """Complete each row's ``prompt_ids`` with ``sampling`` (each row's own ``seed``).

        Needs non-tensor ``prompt_ids`` and ``seed``. Returns the rows with the generation
        fields of :func:`tandem.protocol.sequences.sequence_tensors` (prompts left-padded to
        ``prompt_width``, responses right-padded to ``sampling.max_tokens``) and a
        ``finish_reason`` column.
        """
        self.actor_residency.offload()  # before the phase's window, so its peak shows what this freed
        with self._phase("gen"):
            self._hand_back_cached_memory()
            self.rollout.wake()
            if self.agents is not None:  # multi-turn episodes: tool or user turns between the model's
                out = self.agents.generate(prompts, sampling, prompt_width, self.rank)
            else:
                out = self._single_turn(prompts, sampling, prompt_width)
            if self.config.rollout.free_cache_between_generations:
                self.rollout.sleep()  # the update gets the KV-cache memory; the next generation wakes it
            elif isinstance(self.rollout, NativeRolloutEngine):
                self.rollout.release_packed_weights()  # packed again at the weight sync, once, as before
        return out

    @register(dispatch="DP_COMPUTE")
    def generate_to_store(self, prompts: Batch, *, sampling: SamplingParams, prompt_width: int) -> BatchRef:
        """:meth:`generate_sequences` with its outputs kept in this rank's store: the per-token fields
        as one block, and back only a ``BatchRef`` with the rows' scalars and decoded response texts
        (:func:`tandem.pipeline.stored_rollout.store_rollout`). Rows naming their place in the data
        (``RLDataset.requests``) get their ``prompt_ids`` and ``raw_prompt`` read here first
        (:class:`~tandem.rl.data.prompt_rows.RankPrompts`)."""
        prompts = self.prompt_rows.built(prompts)
        out = self.generate_sequences(prompts, sampling=sampling, prompt_width=prompt_width)
        engine = self.engine
        images = stored_image_layout(engine.causal_lm, prompt_width) if engine.vision_language else None
        return store_rollout(out, self._tandem_data_store(), self.tokenizer, images=images)

    @register(dispatch="DP_COMPUTE", reads=("responses", "response_mask"))
    def response_texts(self, batch: Batch) -> Batch:
        """``response_text``: each row's sampled tokens decoded here, where its tokens are read (the
        validation samples of stored agent episodes, whose scalars carry no text)."""
        return Batch({}, {RESPONSE_TEXT: decode_sampled(self.tokenizer, batch["responses"], batch["response_mask"])})

    def _single_turn(self, prompts: Batch, sampling: SamplingParams, prompt_width: int) -> Batch:
        completions = self.rollout.generate_batch(
            rollout_requests(prompts, prompts["seed"], sampling, str(self.rank))
        )
        raise_failed_requests(completions, f"rollout on rank {self.rank}")
        widths = (prompt_width, sampling.max_tokens)
        return with_completions(prompts, completions, self.tokenizer.pad_token_id, widths)

    @register(dispatch="ONE_TO_ALL")
    def agent_tool_totals(self) -> dict[str, tuple[int, int, float]]:
        """This rank's tools' ``(calls, errors, seconds)`` since the last call."""
        return self.agents.tool_totals() if self.agents is not None else {}

    @register(dispatch="ONE_TO_ALL")
    def sync_rollout_weights(self, version: int) -> int:
        """Copy the trainer's weights into this rank's rollout engine; later tokens carry ``version``.

        An engine put to sleep after generation (``rollout.free_cache_between_generations``)
        takes them asleep: its KV cache comes back only at the next generation, after the
        actor's offload, so the cache and the actor's parameters never share the GPU.
        """
        self.actor_residency.load()
        self._hand_back_cached_memory()
        return self.rollout.update_weights(self.engine.iter_parameters(), version)

    def _hand_back_cached_memory(self) -> None:
        """When the rollout engine sleeps between generations, give the trainer's cached free GPU
        blocks back to the driver before the engine maps its memory back (vLLM's allocator is
        not PyTorch's)."""
        if self.config.rollout.free_cache_between_generations:
            release_cached_memory(self.device)

    # ------------------------------------------------------------------ log-probs
    @register(dispatch=mesh_dispatch(ACTOR_MESH), reads=FORWARD_FIELDS, outputs="ref")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs [B, R]`` of the responses under the current policy, and ``sum_pi_squared
        [B, R]`` (``sum_v pi_old(v)^2`` per response token) when the advantage estimator reads it."""
        with_sum_pi_squared = self.config.algorithm.needs_sum_pi_squared
        with self._phase("old_log_prob"):
            self.actor_residency.load()
            outputs = self.engine.forward_backward(
                batch, None, forward_only=True, with_sum_pi_squared=with_sum_pi_squared
            ).outputs
        width = batch["prompts"].shape[1]
        tensors = {"old_log_probs": response_part(outputs.log_probs, width)}
        if with_sum_pi_squared:
            tensors["sum_pi_squared"] = response_part(outputs.sum_pi_squared, width)
        return Batch(tensors)

    @register(dispatch=mesh_dispatch(ACTOR_MESH), reads=FORWARD_FIELDS, outputs="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_probs [B, R]`` under the frozen reference (the base model when LoRA is on)."""
        with self._phase("ref"):
            if self.reference is not None:
                with self.reference_residency.computing():
                    outputs = self.reference.forward_backward(batch, None, forward_only=True).outputs
            else:
                self.actor_residency.load()
                with self.engine.adapter_disabled():
                    outputs = self.engine.forward_backward(batch, None, forward_only=True).outputs
        return Batch({"ref_log_probs": response_part(outputs.log_probs, batch["prompts"].shape[1])})

    # ------------------------------------------------------------------ advantages
    @register(dispatch=mesh_dispatch(ACTOR_MESH), reads=ADVANTAGE_PART_READS, outputs="ref")
    def compute_advantage_part(
        self, batch: Batch, *, part: str, kl_coef: float, whitening: tuple[float, float] | None
    ) -> Batch:
        """Part ``part`` of the step's advantages on this rank's rows of the stored step (the
        per-token work: :mod:`tandem.rl.rank_advantages`); per-token outputs stay in this rank's
        store, per-row scalars go back inline (:mod:`tandem.rl.ref_advantages` calls it)."""
        return advantage_part(batch, part, self.config.algorithm, kl_coef, whitening)

    # ------------------------------------------------------------------ update
    @register(dispatch=mesh_dispatch(ACTOR_MESH), reads=ACTOR_UPDATE_FIELDS)
    def update_actor(self, batch: Batch, *, step: int) -> dict[str, float]:
        """PPO-style update on this rank's shard: ``ppo_epochs`` passes over its mini-batches.

        Each mini-batch is one optimizer step; the loss divides by the mini-batch's global
        token/sequence counts (all ranks), so the result does not depend on the split.
        Returns metrics averaged over the optimizer steps (``actor/*``).
        """
        config = self.config
        actor = config.actor
        local_mini = config.mini_batch_prompts * config.rollout.n // self.engine.mesh.dims.dp
        collected: dict[str, list[float]] = defaultdict(list)
        skipped_before = self.skipped.total
        with self._phase("update_actor"):
            self.actor_residency.load(optimizer=True)
            for epoch in range(actor.ppo_epochs):
                if "chosen" in batch:  # online DPO's pairs (tandem.rl.preference_pairs)
                    self._update_preference(with_pair_fields(batch), collected)
                else:
                    self._update_epoch(batch, step, epoch, local_mini, collected)
        if config.trainer.lr_schedule_unit == "step":
            self.engine.lr_step()
        self.actor_residency.offload(
            params=False
        )  # the optimizer state waits on the CPU until the next update
        self._probe = batch[:1]
        metrics = {name: reduce_metric(name, values, over_steps=True) for name, values in collected.items()}
        metrics["actor/skipped_updates"] = float(self.skipped.total - skipped_before)
        metrics["actor/skipped_updates_in_a_row"] = float(self.skipped.in_a_row)
        return metrics

    @register(dispatch="ONE_TO_ALL")
    def actor_health(self) -> ModelHealth:
        """The actor's weights (this rank's shards) and the log-probs of the last update's first
        sequence: finite or not (:mod:`tandem.engine.divergence`)."""
        self.actor_residency.load()
        return self.engine.health(self._probe)

    def _update_epoch(
        self, batch: Batch, step: int, epoch: int, local_mini: int, collected: dict[str, list[float]]
    ) -> None:
        """One pass over this rank's mini-batches, one optimizer step each; metrics go into ``collected``."""
        config = self.config
        actor = config.actor
        order = batch
        top_k = 0
        if "teacher_top_ids" in batch:  # the student's log-probs of the teacher's top-k, its greedy token
            order, top_k = with_gather_ids(batch), 1
        if actor.shuffle_mini_batches:
            generator = torch.Generator().manual_seed(
                derive_seed(config.trainer.seed, SHUFFLE_SEED_TAG, step, epoch)
            )
            order = order.reorder(torch.randperm(len(batch), generator=generator))
        for mini in order.split(local_mini):
            normalizer = self.engine.global_normalizer(mini["response_mask"])
            loss_fn = make_actor_loss(
                actor.policy_loss,
                normalizer,
                actor.entropy_coeff,
                config.algorithm.kl,
                config.old_log_probs_from_update,
                config.algorithm.distill if config.distills else None,
            )
            result = self.engine.forward_backward(mini, loss_fn, top_k=top_k)
            self._optimizer_step(result.loss, collected)
            for name, values in result.metrics.items():
                collected[name].append(reduce_metric(name, values))

    def _optimizer_step(self, loss: float, collected: dict[str, list[float]]) -> None:
        """Step the optimizer (skipped when ``loss`` is not finite, and counted) and, per optimizer
        step (``trainer.lr_schedule_unit``), the learning rate; ``actor/grad_norm`` and ``actor/lr``
        go into ``collected``."""
        collected["actor/grad_norm"].append(self.engine.optimizer_step(skip=not math.isfinite(loss)))
        self.skipped.record(self.engine.last_step_skipped)
        collected["actor/lr"].append(self.engine.lr)
        if self.config.trainer.lr_schedule_unit == "optimizer_step":
            self.engine.lr_step()

    def _update_preference(self, batch: Batch, collected: dict[str, list[float]]) -> None:
        """Online DPO: one optimizer step on this rank's whole pairs (chosen and rejected rows with
        ``ref_log_prob``); the loss divides by the pair and chosen-token counts of all ranks."""
        chosen_mask = batch["loss_mask"] * batch["chosen"][:, None]
        counts = self.engine.global_normalizer(chosen_mask)  # tokens: chosen tokens; sequences: pairs
        loss_fn = functools.partial(
            preference_loss,
            config=self.config.actor.preference,
            total_pairs=int(counts.num_seqs),
            chosen_tokens=max(counts.num_tokens, 1.0),
        )
        result = self.engine.forward_backward(batch, loss_fn)
        self._optimizer_step(result.loss, collected)
        collected["actor/preference_loss"].append(result.loss)
        pairs = max(counts.num_seqs, 1.0)  # all ranks': each rank's sums become its share of the means
        for name, values in result.metrics.items():
            if name.startswith(MEAN_PREFIXES):  # the routing metrics: each micro-batch's own mean
                collected[name].append(sum(values) / len(values))
            elif name != "pairs":
                collected[name].append(sum(values) / pairs)

    # ------------------------------------------------------------------ checkpoints and export
    @register(dispatch="ONE_TO_ALL")
    def save_checkpoint(self, path: str) -> None:
        """The actor's model, optimizer, scheduler and RNG states under ``path`` (atomically)."""
        self.actor_residency.load(optimizer=True)
        self.engine.save(path)

    @register(dispatch="ONE_TO_ALL")
    def load_checkpoint(self, path: str, version: int) -> None:
        """Restore the actor from ``path`` and push its weights to the rollout engine as ``version``."""
        self.actor_residency.load(optimizer=True)
        self.engine.load(path)
        if self.rollout is not None:  # replicas get the weights from the pipeline
            self.rollout.update_weights(self.engine.iter_parameters(), version)

    @register(dispatch="ONE_TO_ALL")
    def export_hf(self, path: str) -> None:
        """Write the current policy (LoRA merged) with its tokenizer as a plain HF model directory (rank 0 writes)."""
        self.actor_residency.load()
        self.engine.export_hf(path, self.tokenizer, write=self.rank == 0)

    @register(dispatch="ONE_TO_ALL")
    def shutdown_engines(self) -> None:
        if self.rollout is not None:
            self.rollout.close()


def with_gather_ids(batch: Batch) -> Batch:
    """``batch`` with ``gather_token_ids [B, S, k]``: the teacher's top-k tokens of each response
    position (``teacher_top_ids [B, R, k]``) laid out like ``input_ids``, 0 in the prompt columns;
    the engine returns the student's log-probs of them (:data:`tandem.engine.base.GATHER_FIELD`)."""
    top = batch["teacher_top_ids"]
    prompt = top.new_zeros(top.shape[0], batch["prompts"].shape[1], top.shape[2])
    return batch.assign(tensors={GATHER_FIELD: torch.cat([prompt, top], dim=1)})
