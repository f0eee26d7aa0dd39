"""A worker that holds a training engine (used by the 2-process data-parallel tests)."""

import functools

import torch
from torch.distributed.tensor import DTensor

from tandem.checkpoint_engine.roles import SendsWeights
from tandem.controller import Worker, register
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.engine.offload import storage_of
from tandem.models import load_model
from tandem.protocol import Batch
from tandem.sft.loss import sft_loss


class EngineWorker(SendsWeights, Worker):
    def __init__(self, config: EngineConfig, own_storage: bool = False) -> None:
        """``own_storage``: the weights in storage of their own, not memory-mapped from the
        checkpoint (so an offload can free it on the CPU, as it does on a GPU)."""
        if config.strategy != "single":
            self.init_process_group("gloo")
        model = None
        if own_storage:
            model = load_model(config.model_path)
            for param in model.parameters():
                param.data = param.data.clone()
        self.engine = TorchTrainEngine(config, model=model)
        self.engine.initialize()

    @register(dispatch="DP_COMPUTE")
    def train_step(self, batch: Batch) -> Batch:
        """One optimizer step on this rank's shard; returns the pre-step log-probs and the grad norm."""
        outputs = self.engine.forward_backward(batch, None, forward_only=True).outputs
        normalizer = self.engine.global_normalizer(batch["loss_mask"])
        result = self.engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
        grad_norm = self.engine.optimizer_step()
        size = len(batch)
        return Batch(
            {
                "log_probs": outputs.log_probs,
                "grad_norm": torch.full((size,), grad_norm, dtype=torch.float64),
                "loss": torch.full((size,), result.loss, dtype=torch.float64),
            }
        )

    @register(dispatch="ALL_TO_ALL")
    def train_step_on_shard(self, batch: Batch) -> float:
        """One optimizer step on a shard of this rank's choosing (shards may differ in size)."""
        normalizer = self.engine.global_normalizer(batch["loss_mask"])
        result = self.engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
        self.engine.optimizer_step()
        return result.num_micro_batches

    @register(dispatch="DP_COMPUTE")
    def step_asking_to_skip(self, batch: Batch) -> Batch:
        """One optimizer step where this rank asks to skip when its shard's ``skip`` column is set;
        returns per row whether the step was skipped and whether this rank's parameters moved."""
        local = self._local_parameters
        before = local()
        normalizer = self.engine.global_normalizer(batch["loss_mask"])
        self.engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
        self.engine.optimizer_step(skip=bool(batch["skip"].any()))
        moved = any(not torch.equal(a, b) for a, b in zip(before, local(), strict=True))
        size = len(batch)
        return Batch(
            {
                "skipped": torch.full((size,), self.engine.last_step_skipped),
                "moved": torch.full((size,), moved),
            }
        )

    def _local_parameters(self) -> list[torch.Tensor]:
        """Copies of this rank's parameters (its shards under FSDP2)."""
        params = self.engine.causal_lm.parameters()
        return [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in params]

    @register(dispatch="ONE_TO_ALL")
    def offload_and_load(self, probe: Batch | None = None) -> tuple[list[int], bool]:
        """Offload parameters and optimizer state and reload them, after a forward-only pass
        over ``probe`` when given (as the RL worker's health check runs after each update).
        Returns the bytes the parameters' and the optimizer state's storages held while
        offloaded (0 each: freed) and whether the module's parameters were its FSDP2 shards then
        (not gathered copies; always true for the other strategies)."""
        if probe is not None:
            self.engine.forward_backward(probe, None, forward_only=True)
        self.engine.offload()
        params = [p for p in self.engine.causal_lm.parameters()]
        state = [v for entry in self.engine.optimizer.state.values() for v in entry.values() if v.dim()]
        held = [storage_of(t).nbytes() for t in params + state]
        sharded = self.engine.config.strategy != "fsdp2" or all(isinstance(p, DTensor) for p in params)
        self.engine.reload()
        return held, sharded

    @register(
        dispatch="ONE_TO_ALL"
    )  # under FSDP2 gathering full tensors is a collective: every rank calls it
    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: tensor.clone() for name, tensor in self.engine.iter_parameters()}
