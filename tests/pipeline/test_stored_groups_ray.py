"""A rollout replica's groups kept in Ray's object store (``dataplane.engine=ray``), for trainers on
any node: the block holds the rows the shared-memory writer stores, bit for bit, and the writer's
store lets go of it at once, so that the block lives as long as a reference to it does (the
group's metadata, the controller's queue and step). The two-node run is
tests/dataplane/test_two_nodes_grpo.py (slow)."""

import torch

from tandem.dataplane import DataPlaneConfig, get
from tandem.models import load_tokenizer
from tandem.pipeline.group_blocks import PROMPT_FIELD, GroupBlockWriter
from tandem.pipeline.sample_store import release, stored_nbytes


def group_fields() -> dict[str, torch.Tensor]:
    """A packed group of two responses (3 and 2 tokens) and its prompt, as a tracker packs it."""
    return {
        "token_ids": torch.tensor([11, 12, 13, 21, 22]),
        "log_probs": torch.tensor([-0.5, -1.0, -1.5, -0.25, -2.0]),
        "versions": torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32),
        "lengths": torch.tensor([3, 2]),
        PROMPT_FIELD: torch.tensor([5, 6, 7]),
    }


def test_a_ray_block_holds_the_shm_rows_and_lives_by_its_references(ray_cluster, rl_files, tmp_path):
    tokenizer = load_tokenizer(rl_files["model"])
    (tmp_path / "blocks").mkdir()
    writers = [
        GroupBlockWriter(config, 4, 4, tokenizer.pad_token_id, tokenizer)
        for config in (DataPlaneConfig(directory=str(tmp_path / "blocks")), DataPlaneConfig(engine="ray"))
    ]
    on_shm, on_ray = (writer.write("g0", group_fields()) for writer in writers)
    assert {b.engine for b in on_ray.blocks()} == {"ray"}
    assert writers[1].store.held_blocks == 0  # handed to the references: none left to release
    assert 0 < stored_nbytes(on_ray) <= writers[1].size_of(group_fields())  # the queue's byte bound counts it
    expected, got = on_shm.materialise(get), on_ray.materialise(get)
    assert got.keys() == expected.keys()
    for name, value in expected.tensors.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    writers[1].discard_all()  # nothing of this process's to delete: a Ray block goes with its references
    release(on_shm)
    assert not list((tmp_path / "blocks").iterdir())
