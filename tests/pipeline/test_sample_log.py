"""The replicas' sample log (``pipeline.record_schedule``): groups appended and read back bit for bit,
in the narrow wire form, a tail cut short by a crash left out, a damaged entry named."""

import math
import re
import struct

import pytest
import torch

from tandem.dataplane.columns import encode
from tandem.pipeline.sample_log import SampleLog, log_directory, read_entry, read_log


def _group(seed: int) -> dict[str, torch.Tensor]:
    """A group's sample-file arrays (two responses of 3 and 4 tokens), with edge values."""
    generator = torch.Generator().manual_seed(seed)
    log_probs = -torch.rand(7, generator=generator)
    log_probs[2] = float("nan")  # bits kept as they are, NaN included
    log_probs[3] = -math.inf
    return {
        "token_ids": torch.tensor([5, 2**40, 0, 7, 7, 1, 3], dtype=torch.int64),  # one needs int64
        "log_probs": log_probs,
        "versions": torch.tensor([0, 0, 1, 1, 1, 2, 2], dtype=torch.int64),
        "lengths": torch.tensor([3, 4], dtype=torch.int64),
        "routed_experts": torch.randint(0, 8, (9, 2, 2), generator=generator, dtype=torch.int64),
        "bf16": torch.randn(4, generator=generator).bfloat16(),
        "token_mask": torch.zeros(0, dtype=torch.int64),  # empty arrays round-trip too
    }


def _assert_bit_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
        assert torch.equal(got[name].view(width), tensor.view(width)), name  # bits, NaN included


def test_groups_appended_read_back_bit_for_bit_by_reference_and_in_order(tmp_path):
    directory = log_directory(str(tmp_path / "run" / "schedule.jsonl"))
    assert directory == str(tmp_path / "run" / "schedule.jsonl.samples")  # beside the record
    log = SampleLog(directory, replica=1)
    groups = {f"g{k}": _group(k) for k in range(3)}
    references = {uid: log.append(uid, tensors) for uid, tensors in groups.items()}
    assert all(re.fullmatch(r"replica1-\d+\.log@\d+", ref) for ref in references.values())
    for uid in ["g2", "g0", "g1"]:  # any entry, by its reference
        got_uid, tensors = read_entry(directory, references[uid])
        assert got_uid == uid
        _assert_bit_equal(tensors, groups[uid])
    entries = read_log(f"{directory}/{log.name}")
    assert [(f"{log.name}@{offset}", uid) for offset, uid, _ in entries] == [
        (references[u], u) for u in groups
    ]
    # the payload is the wire form's arrays (integers narrowed: versions as uint8, token ids as int64
    # here since one needs it), not the int64 arrays
    with open(f"{directory}/{log.name}", "rb") as file:
        _, _, payload = struct.unpack("<4sQQ", file.read(20))
    _, arrays = encode(groups["g0"])
    assert arrays["versions.values"].dtype == torch.uint8
    assert payload == sum(a.numel() * a.element_size() for a in arrays.values())


def test_a_tail_cut_short_is_left_out_and_a_damaged_entry_is_an_error(tmp_path):
    log = SampleLog(str(tmp_path), replica=0)
    first = log.append("g0", _group(0))
    second = log.append("g1", _group(1))
    path = tmp_path / log.name
    whole = path.read_bytes()
    for cut in (len(whole) - 1, len(whole) - 40, int(second.rpartition("@")[2]) + 5):
        path.write_bytes(whole[:cut])  # the replica died writing g1
        assert [uid for _, uid, _ in read_log(str(path))] == ["g0"]
        with pytest.raises(ValueError, match="cut short or corrupt"):
            read_entry(str(tmp_path), second)
        _assert_bit_equal(read_entry(str(tmp_path), first)[1], _group(0))
    damaged = bytearray(whole)
    damaged[int(second.rpartition("@")[2]) + 200] ^= 0xFF  # a flipped byte fails the CRC
    path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"replica0-\d+\.log: the entry at byte \d+ is cut short or corrupt"):
        read_entry(str(tmp_path), second)
    with pytest.raises(ValueError, match="not a <file>@<offset> reference"):
        read_entry(str(tmp_path), "../elsewhere@0")
