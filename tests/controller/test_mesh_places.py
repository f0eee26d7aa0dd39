"""``mesh_dispatch`` checks the places its ranks declared (it never works a layout out): they agree
on the data-parallel size and collect each data-parallel rank exactly once; the places an
engine's ``ParallelDims`` gives every rank pass, for every layout of eight ranks."""

from __future__ import annotations

import pytest
import torch

from tandem.controller.dispatch import DispatchError, MeshRank, check_mesh_places, mesh_dispatch
from tandem.controller.group import GroupSnapshot
from tandem.engine.parallel_dims import ParallelDims
from tandem.protocol import Batch


def _rows(count: int) -> Batch:
    return Batch({"input_ids": torch.arange(count)[:, None]})


@pytest.mark.parametrize("sp,tp,ep", [(1, 1, 1), (2, 1, 2), (1, 2, 4), (2, 2, 2), (4, 2, 1), (1, 8, 1)])
def test_the_places_parallel_dims_gives_split_rows_as_its_data_parallel_ranks(sp, tp, ep):
    dims = ParallelDims(8, sp=sp, tp=tp, ep=ep)
    places = [dims.mesh_rank(rank) for rank in range(8)]
    assert check_mesh_places("actor", places) == dims.dp
    group = GroupSnapshot(world_size=8, meshes={"actor": places})
    per_rank, _, pad = mesh_dispatch("actor").split(group, (_rows(6),), {})
    for rank, (chunk,) in enumerate(per_rank):  # each rank: its data-parallel rank's chunk
        dp_rank = dims.coordinates(rank)[0]
        whole = _rows(6).pad_to_divisor(dims.dp)[0].chunk(dims.dp)[dp_rank]
        assert torch.equal(chunk["input_ids"], whole["input_ids"])


@pytest.mark.parametrize(
    "places,message",
    [
        ([MeshRank(0, 2, True), MeshRank(1, 4, True)], r"declare different data-parallel sizes \[2, 4\]"),
        ([MeshRank(0, 2, True), MeshRank(0, 2, True)], r"report data-parallel ranks \[0, 0\]: each of 0..1"),
        ([MeshRank(0, 2, True), MeshRank(1, 2, False)], r"report data-parallel ranks \[0\]"),
    ],
    ids=["sizes", "repeated", "dropped"],
)
def test_places_that_would_drop_or_repeat_rows_are_refused(places, message):
    group = GroupSnapshot(world_size=2, meshes={"tp": places})
    with pytest.raises(DispatchError, match=message):
        mesh_dispatch("tp").split(group, (_rows(4),), {})
