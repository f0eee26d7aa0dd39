"""Stage workers the data-plane tests run (importable, so spawned processes can load them)."""

import torch

from tandem.controller import Worker, mesh_dispatch, register
from tandem.protocol import Batch

READS = ("input_ids", "attention_mask", "prompts", "uid")


class StageWorker(Worker):
    """Two stages of a step, each a pure function of the fields it declares: a forward-like one
    that keeps its output where it ran, and a loss-like one over the first one's output."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def _forward(self, batch: Batch) -> Batch:
        self.seen.append(sorted(batch.keys()))
        width = batch["prompts"].shape[1]
        ids = batch["input_ids"].double()
        log_probs = -(torch.log1p(ids) * batch["attention_mask"]).float()[:, width:]
        return Batch({"old_log_probs": log_probs}, {"uid_seen": list(batch["uid"])})

    @register(dispatch="DP_COMPUTE", reads=READS)
    def forward(self, batch: Batch) -> Batch:
        return self._forward(batch)

    @register(dispatch="DP_COMPUTE", reads=READS, outputs="ref")
    def forward_kept(self, batch: Batch) -> Batch:
        return self._forward(batch)

    @register(dispatch="DP_COMPUTE", reads=("old_log_probs", "response_mask"), outputs="ref")
    def loss_kept(self, batch: Batch) -> Batch:
        self.seen.append(sorted(batch.keys()))
        return Batch({"loss_terms": (batch["old_log_probs"] * batch["response_mask"]).sum(1)})

    @register(dispatch=mesh_dispatch("reversed"), reads=READS)
    def forward_on_mesh(self, batch: Batch) -> Batch:
        return self._forward(batch)

    @register(dispatch="ONE_TO_ALL")
    def declare_reversed_mesh(self) -> None:
        """dp rank ``world - 1 - rank``: the mesh's chunks go to the ranks in reverse."""
        self.set_mesh_rank("reversed", self.world_size - 1 - self.rank, self.world_size, True)

    @register(dispatch="ONE_TO_ALL")
    def fields_seen(self) -> list[list[str]]:
        seen, self.seen = self.seen, []
        return seen
