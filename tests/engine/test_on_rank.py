"""The shared "engine on this rank" set-up (:mod:`tandem.engine.on_rank`): which rank reports its
data-parallel rank's rows, for (dp, sp, tp) layouts against a table worked by hand, and the
strategy a group's ranks run."""

from __future__ import annotations

import pytest

from tandem.controller.dispatch import MeshRank
from tandem.engine.config import EngineConfig
from tandem.engine.mesh import EngineMesh
from tandem.engine.on_rank import group_strategy, mesh_place, talks_to_peers
from tandem.engine.parallel_dims import ParallelDims

T, F = True, False
# (dp, sp, tp) -> each rank's (dp_rank, collects), rank = (d * sp + s) * tp + t: the first rank of
# each sp x tp block (the ranks holding one data-parallel rank's rows) reports them.
HAND_WORKED = {
    (4, 1, 1): [(0, T), (1, T), (2, T), (3, T)],
    (2, 2, 1): [(0, T), (0, F), (1, T), (1, F)],
    (2, 1, 2): [(0, T), (0, F), (1, T), (1, F)],
    (1, 4, 1): [(0, T), (0, F), (0, F), (0, F)],
    (1, 1, 4): [(0, T), (0, F), (0, F), (0, F)],
    (1, 2, 2): [(0, T), (0, F), (0, F), (0, F)],
    (2, 2, 2): [(0, T), (0, F), (0, F), (0, F), (1, T), (1, F), (1, F), (1, F)],
    (4, 1, 2): [(0, T), (0, F), (1, T), (1, F), (2, T), (2, F), (3, T), (3, F)],
    (2, 4, 1): [(0, T), (0, F), (0, F), (0, F), (1, T), (1, F), (1, F), (1, F)],
}


@pytest.mark.parametrize("layout", list(HAND_WORKED), ids=lambda shape: "dp{}-sp{}-tp{}".format(*shape))
def test_each_data_parallel_rank_is_reported_by_exactly_the_first_rank_of_its_block(layout):
    dp, sp, tp = layout
    world = dp * sp * tp
    dims = ParallelDims(world, sp, tp)
    places = []
    for rank in range(world):
        dp_rank, sp_rank, tp_rank = dims.coordinates(rank)
        mesh = EngineMesh(dp, sp, dp_rank, sp_rank, None, tp_size=tp, tp_rank=tp_rank)
        places.append(mesh_place(mesh, rank, world))
    assert places == [MeshRank(dp_rank, dp, collects) for dp_rank, collects in HAND_WORKED[layout]]


def test_an_engine_alone_on_each_rank_is_the_groups_data_parallel_rank():
    """A frozen whole copy per rank (no collectives, a one-rank mesh): rank r of a group of 3
    scores chunk r and reports it, as the engine's own mesh would call it rank 0 of 1."""
    places = [mesh_place(EngineMesh.flat(), rank, 3) for rank in range(3)]
    assert places == [MeshRank(0, 3, True), MeshRank(1, 3, True), MeshRank(2, 3, True)]


def test_a_mesh_spanning_another_number_of_ranks_than_the_group_is_refused():
    with pytest.raises(ValueError, match="spans 2 ranks but its worker group has 4"):
        mesh_place(EngineMesh.flat(2, 1), 1, 4)


@pytest.mark.parametrize(
    ("configured", "world", "tp", "frozen", "expected"),
    [
        ("single", 1, 1, False, "single"),
        ("fsdp2", 1, 1, False, "single"),  # DDP or FSDP2 over one rank is the single process
        ("single", 2, 1, False, "ddp"),
        ("single", 2, 1, True, "single"),  # a frozen engine has no gradients to reduce
        ("ddp", 4, 1, True, "single"),
        ("fsdp2", 2, 1, True, "fsdp2"),  # sharded to save memory, frozen or not
        ("single", 2, 2, False, "single"),  # one tensor-parallel group
        ("single", 4, 2, True, "single"),
        ("fsdp2", 4, 2, False, "fsdp2"),
    ],
)
def test_the_strategy_each_rank_of_a_group_runs(configured, world, tp, frozen, expected):
    assert group_strategy(configured, world, tp, frozen) == expected


def test_only_an_engine_that_runs_collectives_joins_the_process_group():
    alone = EngineConfig(model_path="m")
    assert not talks_to_peers(alone)
    for field, value in (("strategy", "ddp"), ("sp_size", 2), ("tp_size", 2), ("ep_size", 2)):
        assert talks_to_peers(EngineConfig(model_path="m", **{field: value})), field
