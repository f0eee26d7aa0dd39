"""Expert parallelism with sequence x tensor parallelism, on the one ``(dp, sp, tp)`` mesh whose
flattened ``dp_sp`` dimension is viewed as ``(edp, ep)``: :class:`ParallelDims`' expert layout
against a table worked by hand (and torch's row-major layout), its refusals naming the keys, each
rank's place for dispatch; and four gloo ranks ``(dp, sp, tp) = (1, 2, 2)`` with ``ep=2`` against
one process (outputs, loss, every gathered gradient, an optimizer step)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.controller.dispatch import MeshRank
from tandem.engine.parallel_dims import ParallelDims
from tandem.models import TinyModelConfig, save_tiny_model
from tests.engine.ep_sp_tp_workers import ExpertGroupsWorker
from tests.engine.mesh_comparisons import (
    assert_same_gradients,
    assert_same_step,
    mesh_config,
    mesh_groups,
    train_step,
)
from tests.engine.test_expert_parallel import EXPERTS, _routed_batch

# (dp, sp, tp, ep) -> the expert-parallel groups (global ranks, each group's ranks in ep-rank
# order) and each rank's (edp_rank, ep_rank). Rank r = (d * sp + s) * tp + t; the ranks holding
# different tokens in tensor-parallel slice t are f = d * sp + s, and the groups are runs of ep
# consecutive f: f = edp_rank * ep + ep_rank.
HAND_WORKED = {
    (1, 2, 2, 2): ([[0, 2], [1, 3]], [(0, 0), (0, 0), (0, 1), (0, 1)]),  # a group: an sp group
    (2, 2, 1, 2): ([[0, 1], [2, 3]], [(0, 0), (0, 1), (1, 0), (1, 1)]),
    (2, 2, 1, 4): ([[0, 1, 2, 3]], [(0, 0), (0, 1), (0, 2), (0, 3)]),  # spans both sp groups
    (2, 1, 2, 2): ([[0, 2], [1, 3]], [(0, 0), (0, 0), (0, 1), (0, 1)]),
    (1, 4, 1, 2): ([[0, 1], [2, 3]], [(0, 0), (0, 1), (1, 0), (1, 1)]),  # halves of one sp group
    (2, 2, 2, 2): (
        [[0, 2], [1, 3], [4, 6], [5, 7]],
        [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0), (1, 1), (1, 1)],
    ),
    (2, 2, 2, 4): (
        [[0, 2, 4, 6], [1, 3, 5, 7]],
        [(0, 0), (0, 0), (0, 1), (0, 1), (0, 2), (0, 2), (0, 3), (0, 3)],
    ),
    (3, 2, 1, 3): (
        [[0, 1, 2], [3, 4, 5]],
        [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)],
    ),  # across sp groups
}


def _ids(layout: tuple[int, ...]) -> str:
    return "dp{}-sp{}-tp{}-ep{}".format(*layout)


# ---------------------------------------------------------------- arithmetic, no process group
@pytest.mark.parametrize("layout", list(HAND_WORKED), ids=_ids)
def test_expert_groups_are_runs_of_the_dp_sp_ranks_of_one_tensor_parallel_slice(layout):
    dp, sp, tp, ep = layout
    dims = ParallelDims(dp * sp * tp, sp=sp, tp=tp, ep=ep)
    dims.check()
    groups, places = HAND_WORKED[layout]
    assert (dims.dp, dims.edp) == (dp, dp * sp // ep)
    assert dims.expert_groups() == groups
    assert [dims.expert_coordinates(rank)[:2] for rank in range(dims.world)] == places
    # torch's row-major layout: the (dp, sp, tp) mesh's dp_sp dimension unflattened into (edp, ep)
    layout_tensor = torch.arange(dims.world).view(dp * sp, tp).view(dims.edp, ep, tp)
    for rank in range(dims.world):
        assert layout_tensor[dims.expert_coordinates(rank)] == rank
    assert sorted(r for group in groups for r in group) == list(range(dims.world))


@pytest.mark.parametrize(
    "dims,message",
    [
        (ParallelDims(8, sp=2, tp=2, ep=8), r"engine.ep_size=8 must divide the 4 data-parallel ranks \(the world size 8 over engine.tp_size=2\)"),
        (ParallelDims(8, sp=2, tp=2, ep=3), r"engine.ep_size=3 must divide the 4 data-parallel ranks"),
        (ParallelDims(4, sp=2, ep=8), r"engine.ep_size=8 must divide the world size 4"),
    ],
    ids=["ep-over-tp", "ep-not-dividing", "world"],
)  # fmt: skip
def test_expert_parallel_sizes_that_do_not_divide_are_refused_naming_the_keys(dims, message):
    with pytest.raises(ValueError, match=message):
        dims.check()


def test_a_trainers_workers_are_named_in_the_expert_refusal():
    message = r"actor.engine.ep_size=4 must divide the 2 data-parallel workers \(the 4 workers over actor.engine.tp_size=2\)"
    with pytest.raises(ValueError, match=message):
        ParallelDims(4, sp=1, tp=2, ep=4).check("actor.engine", world="the 4 workers", unit="workers")


def test_expert_parallelism_leaves_each_ranks_place_for_dispatch_as_it_was():
    """``ep`` splits experts, not rows: the dp rank and the collect flag are the ``(dp, sp, tp)``
    ones (the first rank of each ``sp x tp`` block reports its rows)."""
    dims = ParallelDims(8, sp=2, tp=2, ep=2)
    places = [dims.mesh_rank(rank) for rank in range(8)]
    expected = [MeshRank(rank // 4, 2, rank % 4 == 0) for rank in range(8)]
    assert places == expected == [ParallelDims(8, sp=2, tp=2).mesh_rank(rank) for rank in range(8)]


# ---------------------------------------------------------------- four gloo ranks
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Tiny MoE models with 4 experts and 4 query / 2 key-value heads (over ``tp=2`` one key/value
    head a rank, repeated for its two ``sp`` ranks)."""
    root = tmp_path_factory.mktemp("ep_sp_tp")
    families = ("qwen2_moe", "qwen3_moe")
    return {
        f: str(save_tiny_model(root / f, TinyModelConfig(family=f, num_heads=4, num_kv_heads=2)))
        for f in families
    }


one_process, _, _ = mesh_groups(ExpertGroupsWorker, "expert-parallel")


@pytest.fixture(scope="module")
def four_ranks():
    with create_worker_group(ExpertGroupsWorker, ResourcePool((4,)), "process") as group:
        yield group


SP_TP_EP = {"sp_size": 2, "tp_size": 2, "ep_size": 2, "strategy": "fsdp2"}


@pytest.mark.slow  # four processes start on a 2-core machine
@pytest.mark.parametrize(
    "model,overrides",
    [
        ("qwen2_moe", {"router_replay": "rollout", "moe_aux_loss_coef": 0.1}),
        ("qwen3_moe", {"gradient_checkpointing": True}),
    ],
    ids=["qwen2-replay-aux", "qwen3-checkpointing"],
)
def test_ep_with_sp_x_tp_ranks_equal_one_process(model_dirs, one_process, four_ranks, model, overrides):
    """``(dp, sp, tp) = (1, 2, 2)``, ``ep=2``: each tensor-parallel slice's two sequence-parallel
    ranks split the experts and exchange their sequence shards' tokens; outputs (log-probs,
    entropy), loss and every gradient (expert shards gathered) equal one process's."""
    batch = _routed_batch(13)
    config = mesh_config(model_dirs[model], **overrides)
    one_process.build(config)
    whole = one_process.gradients(batch)[0]
    four_ranks.build(dataclasses.replace(config, **SP_TP_EP))
    assert all(set(held.values()) == {EXPERTS // 2} for held in four_ranks.local_experts())
    dims = ParallelDims(4, sp=2, tp=2, ep=2)
    groups = four_ranks.expert_groups()
    assert [got["dispatch"] for got in groups] == [dims.expert_groups()[rank % 2] for rank in range(4)]
    assert [got["reduce"] for got in groups] == [[rank] for rank in range(4)]  # edp = 1
    assert_same_gradients(four_ranks.gradients(batch), whole)


@pytest.mark.slow
def test_ep_with_sp_x_tp_optimizer_step_equals_one_process(model_dirs, one_process, four_ranks):
    """One clipped optimizer step on the same mesh: outputs, grad norm (the expert shards' part
    reduced over ``ep``), loss and every updated weight."""
    batch = _routed_batch(14)
    config = mesh_config(model_dirs["qwen3_moe"], router_replay="rollout", grad_clip=0.5)
    one_process.build(config)
    whole = train_step(one_process, batch)
    four_ranks.build(dataclasses.replace(config, **SP_TP_EP))
    assert_same_step(train_step(four_ranks, batch), whole)
