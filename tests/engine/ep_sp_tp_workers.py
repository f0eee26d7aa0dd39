"""A worker holding an expert-parallel training engine that also reports the groups its MoE layers
exchange tokens and reduce expert gradients in (the EP x SP x TP tests' processes)."""

from __future__ import annotations

import torch.distributed as dist

from tandem.controller import register
from tandem.models.sharded_experts import ShardedExperts
from tests.engine.expert_parallel_workers import ExpertParallelWorker


class ExpertGroupsWorker(ExpertParallelWorker):
    """:class:`ExpertParallelWorker` that reports the ranks of its experts' groups."""

    @register(dispatch="ONE_TO_ALL")
    def expert_groups(self) -> dict[str, list[int]]:
        """The global ranks of the group the MoE layers exchange tokens in (``dispatch``) and of
        the group an expert shard's gradient is summed over (``reduce``: this rank alone when none)."""
        layers = [module for module in self.engine.causal_lm.modules() if isinstance(module, ShardedExperts)]
        groups = {(id(layer.group), id(layer.grad_group)) for layer in layers}
        assert len(groups) == 1, "every MoE layer uses the same two groups"
        layer = layers[0]
        reduce = [self.rank] if layer.grad_group is None else dist.get_process_group_ranks(layer.grad_group)
        return {"dispatch": dist.get_process_group_ranks(layer.group), "reduce": reduce}
