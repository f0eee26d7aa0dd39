"""A worker holding a training engine whose experts are split over the data-parallel ranks
(the expert-parallelism tests' processes)."""

from __future__ import annotations

from tandem.controller import register
from tandem.protocol import Batch
from tests.engine.tensor_parallel_workers import TensorParallelWorker


class ExpertParallelWorker(TensorParallelWorker):
    """:class:`TensorParallelWorker` with gradients of each rank's own rows (the expert-parallel
    ranks are data-parallel ranks: each is handed its own part of a batch)."""

    @register(dispatch="ALL_TO_ALL")
    def shard_gradients(self, batch: Batch) -> dict:
        """This rank's outputs of its rows, its loss share and the full gradient of every
        trainable parameter (an expert shard's gathered over the expert-parallel group)."""
        return TensorParallelWorker.gradients(self, batch)  # the same method, dispatched per rank

    @register(dispatch="ONE_TO_ALL")
    def local_experts(self) -> dict[str, int]:
        """How many experts of each expert tensor this rank holds."""
        return {
            name: param.to_local().shape[0]
            for name, param in self.engine.causal_lm.named_parameters()
            if name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        }
