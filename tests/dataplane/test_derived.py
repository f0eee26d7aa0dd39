"""Fields stored as less than their values: a mask of ones as its windows alone, ``input_ids`` and
``position_ids`` derived on the reader from the block's other fields. Each round trip is compared
with the padded tensors put, bit for bit; a field unlike its derivation is stored as before; and
the bytes on the wire per real response token of a fixed batch are pinned (counted, not timed).
"""

import itertools

import numpy as np
import pytest
import torch

from tandem.dataplane import ShmStore, traffic
from tandem.dataplane.columns import encode, read_columns
from tandem.dataplane.ray_store import gather_rows, gathered_arrays
from tandem.dataplane.store import decode_rows
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import sequence_tensors

PAD = 0
BENCH_READS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def protocol_rows(rows: int = 9, prompt: int = 32, response: int = 96, seed: int = 0) -> dict:
    """The rollout's fields as ``sequence_tensors`` builds them (the protocol's own layout), of
    jagged prompts and responses; row 0's response ends in a pad-valued token (eos = pad)."""
    gen = torch.Generator().manual_seed(seed)
    prompts, completions = [], []
    for i in range(rows):
        p = int(torch.randint(prompt // 4, prompt + 1, (1,), generator=gen))
        r = int(torch.randint(1, response + 1, (1,), generator=gen))
        prompts.append(torch.randint(1, 150_000, (p,), generator=gen).tolist())
        tokens = torch.randint(1, 150_000, (r,), generator=gen).tolist()
        tokens[-1] = PAD if i == 0 else tokens[-1]
        completions.append(
            Completion(f"r{i}", tuple(prompts[-1]), tokens, [-0.5] * r, [3] * r, finish_reason="stop")
        )
    return sequence_tensors(prompts, completions, PAD)


def round_trips(store, fields: dict) -> None:
    """Every subset of ``fields`` of several row sets equals the padded tensors' rows, dtype and bits."""
    block = store.put(fields)
    names = list(fields)
    for count in (1, 2, len(names)):
        for asked, rows in itertools.product(itertools.combinations(names, count), ([0, 2, 3], [4], [])):
            got = store.get(block, list(asked), rows)
            assert list(got) == list(asked)
            for name in asked:
                assert got[name].dtype == fields[name].dtype and torch.equal(got[name], fields[name][rows])
    store.release(block)


def test_the_protocols_layout_stores_neither_ids_nor_positions_and_round_trips(tmp_path):
    fields = protocol_rows()
    columns = {c.name: c for c in encode(fields)[0]}
    assert columns["input_ids"].sources == ("prompts", "responses")
    assert columns["position_ids"].sources == ("attention_mask",)
    assert columns["attention_mask"].constant_bits == 1
    # ones, or (its fill being 1) the zeros after them
    assert columns["response_mask"].constant_bits is not None
    assert columns["weight_version"].constant_bits is not None  # one version: windows alone too
    assert columns["responses"].constant_bits is None and not columns["responses"].sources
    round_trips(ShmStore(str(tmp_path)), {k: fields[k] for k in (*BENCH_READS, "prompts")})


@pytest.mark.parametrize("change", ["positions", "ids", "mask hole", "mask bool"])
def test_a_field_unlike_its_derivation_is_stored_and_round_trips(tmp_path, change):
    """An agent's positions, ids of another layout, a mask with holes: stored with their values."""
    fields = {k: v.clone() for k, v in protocol_rows(rows=6, prompt=8, response=12).items()}
    if change == "positions":
        fields["position_ids"][2, -1] += 1
    elif change == "ids":
        fields["input_ids"][1, 3] = 7
    elif change == "mask hole":
        row = int((fields["response_mask"].sum(1) >= 4).nonzero()[0])
        fields["response_mask"][row, 1] = 0  # between sampled tokens
    else:  # a bool mask: positions derive from it all the same, as int64
        fields["attention_mask"] = fields["attention_mask"].bool()
    columns = {c.name: c for c in encode(fields)[0]}
    stored = {"positions": "position_ids", "ids": "input_ids", "mask hole": "response_mask"}.get(change)
    if stored is not None:
        assert not columns[stored].sources and columns[stored].constant_bits is None
    else:
        assert columns["position_ids"].sources == ("attention_mask",)
    round_trips(ShmStore(str(tmp_path)), {k: fields[k] for k in (*BENCH_READS, "prompts")})


def test_ids_of_narrower_sources_are_derived_and_built_apart(tmp_path):
    """Prompts and responses of int32 under int64 ids: ``input_ids`` still derives from them, and a
    fetch builds it from their own outputs (their bits are not the ids' columns)."""
    fields = dict(protocol_rows(rows=7, prompt=10, response=14))
    fields["prompts"], fields["responses"] = fields["prompts"].int(), fields["responses"].int()
    assert {c.name: c for c in encode(fields)[0]}["input_ids"].sources == ("prompts", "responses")
    round_trips(ShmStore(str(tmp_path)), {k: fields[k] for k in ("input_ids", "prompts", "responses")})


def test_a_mask_whose_edges_are_mostly_ones_is_stored_as_its_windows_of_ones(tmp_path):
    """Full rows make 1 the edges' most common value (the fill the windows are cut by); a row
    padded on both sides then breaks windows of zeros, so the mask is cut by 0 instead."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 1]])
    fields = {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    columns = {c.name: c for c in encode(fields)[0]}
    assert (columns["attention_mask"].fill_bits, columns["attention_mask"].constant_bits) == (0, 1)
    assert columns["position_ids"].sources == ("attention_mask",)
    round_trips(ShmStore(str(tmp_path)), fields)


def test_the_gather_for_another_node_reads_the_sources_and_builds_alike():
    """The Ray engine's path across nodes without a cluster: ``gather_rows`` on the block's arrays
    cuts out the sources' rows (no values of a mask of ones), the reader decodes and derives."""
    fields = protocol_rows(rows=7)
    columns, arrays = encode(fields)
    objects = [{n: (str(a.dtype).removeprefix("torch."), tuple(a.shape), a.reshape(-1).view(torch.uint8).numpy())
                for n, a in arrays.items()}]  # fmt: skip
    rows = np.array([1, 2, 5], dtype=np.int64)
    read = read_columns(columns, ["input_ids", "position_ids"])
    assert [c.name for c in read] == ["prompts", "responses", "attention_mask"]
    compact = gather_rows(read, rows, *objects)
    assert "attention_mask.values" not in compact and "input_ids.values" not in compact
    got = decode_rows(columns, gathered_arrays(read, compact), np.arange(3), ["input_ids", "position_ids"])
    for name in ("input_ids", "position_ids"):
        assert torch.equal(got[name], fields[name][rows])


def test_the_ray_engine_stores_no_object_of_a_derived_field_and_reads_alike(ray_cluster):
    """Through a real Ray store on its own node (the gather for another node: the test above)."""
    from tandem.dataplane.ray_store import RayStore

    store = RayStore()
    fields = protocol_rows(rows=7)
    block = store.put(fields)
    assert len(block.refs) == len(fields) - 2  # no object for input_ids and position_ids
    got = store.get(block, ["input_ids", "position_ids", "responses"], [0, 3, 4])
    for name, tensor in got.items():
        assert torch.equal(tensor, fields[name][[0, 3, 4]]), name
    store.release(block)
    assert store.held_blocks == 0


def test_bytes_on_the_wire_per_real_response_token_of_a_fixed_batch(tmp_path):
    """The bench's log-prob stage reads of a fixed 9-row batch (prompts 8-32, responses 1-96
    tokens): the ids' values as the prompts' and responses' int32 (4 bytes a real token), an int32
    length and start a row of each of the four jagged fields read, nothing else. 5.5 bytes per real
    response token; the layout before (ids, masks and positions each stored) took 16.9."""
    fields = protocol_rows()
    store = ShmStore(str(tmp_path))
    block = store.put(fields)
    before = traffic()
    store.get(block, list(BENCH_READS), range(9))
    fetched = traffic() - before
    store.release(block)
    prompt_tokens = int(fields["attention_mask"][:, :32].sum())
    response_tokens = int(fields["response_mask"].sum())
    assert fetched.fetched_by_field == {"prompts": 4 * prompt_tokens, "responses": 4 * (response_tokens - 1)}
    assert fetched.fetched_index_bytes == 9 * 8 * 4  # prompts, responses and the two masks' windows
    wire = fetched.fetched_bytes + fetched.fetched_index_bytes
    assert (prompt_tokens, response_tokens, wire) == (205, 316, 2368)
    assert wire / response_tokens <= 16
