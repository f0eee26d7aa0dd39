"""RL prompts read on the rank (``tandem.rl.data.prompt_rows``): a request naming each row's place
in the data files (``RLDataset.requests``), sent over the wire and rebuilt on a rank with its own
tokenizer, gives for every row of the dataset (truncated ones, typed special tokens, two files,
filtered rows skipped) exactly the rows ``RLDataset.collate`` gives the controller, in fewer bytes;
and in a GRPO run with the data plane on, the workers generating from such requests give the
metrics of requests carrying the prompts' ids, step for step."""

import pytest
import torch

from tandem.data import write_parquet
from tandem.models.loading import load_tokenizer
from tandem.protocol.serialize import from_bytes, to_bytes
from tandem.protocol.traffic import batch_traffic
from tandem.rl.data import ArithmeticTaskConfig, RLDataset, arithmetic_rows, image_reader
from tandem.rl.data.dataset import PROMPT_PLACE, PROMPT_SOURCE
from tandem.rl.data.prompt_rows import RankPrompts
from tests.rl.conftest import small_config
from tests.rl.test_vlm_grpo import vlm_config, vlm_files  # noqa: F401 (the tiny VLM and its shapes data)

LIMIT = 40  # data.max_prompt_length of the tests: the long rows below are cut or dropped


def _files(tmp_path):
    """Two files: short arithmetic prompts, some far over ``LIMIT``, one with typed special tokens."""
    first = arithmetic_rows(12, ArithmeticTaskConfig(), seed=0)
    first[2]["prompt"][0]["content"] = "1234567890" * 9
    first[5]["prompt"][0]["content"] = "1+1=<|im_end|>\n<|im_start|>assistant\n3"
    first[7]["prompt"] = [{"role": "system", "content": "add " * 30}, first[7]["prompt"][0]]
    second = arithmetic_rows(9, ArithmeticTaskConfig(max_digits=3), seed=1)
    second[0]["prompt"][0]["content"] = "98765" * 20
    second[8]["prompt"][0]["content"] = "x" * (LIMIT - 5)  # about the limit, with the template's tokens
    return [write_parquet(first, tmp_path / "a.parquet"), write_parquet(second, tmp_path / "b.parquet")]


def _payload(batch) -> int:
    """The bytes ``batch_traffic`` counts when ``batch`` is sent: its tensors and pickled columns."""
    before = batch_traffic()
    to_bytes(batch)
    return (batch_traffic() - before).serialised


def _columns(batch) -> dict:
    """Every column of ``batch`` as Python values, by name (column order aside)."""
    return {
        k: batch[k].tolist() if isinstance(batch[k], torch.Tensor) else list(batch[k]) for k in batch.keys()
    }


@pytest.mark.parametrize("special", ["text", "control"])
@pytest.mark.parametrize("overlong", ["filter", "truncate_left", "truncate_right", "truncate_middle"])
def test_every_row_built_on_the_rank_equals_the_controllers(rl_files, tmp_path, overlong, special):
    files = _files(tmp_path)
    data = RLDataset.load(files, load_tokenizer(rl_files["model"]), LIMIT, overlong, None, special)
    if overlong == "filter":
        assert data.filtered > 0
    else:
        assert max(len(s.prompt_ids) for s in data.samples) == LIMIT  # some rows were cut
    indices = list(range(len(data)))[::-1]  # every row, in an order not the files'
    expected = data.collate(indices)
    request = data.requests(indices).repeat(2, interleave=True)  # as a draw's groups are
    assert "prompt_ids" not in request and "raw_prompt" not in request
    sent = to_bytes(request)
    rank = RankPrompts(load_tokenizer(rl_files["model"]), [data.source])  # its own tokenizer
    on_rank = rank.built(from_bytes(sent))
    assert _columns(on_rank) == _columns(expected.repeat(2, interleave=True))
    assert on_rank.meta == expected.meta
    assert _payload(request) < _payload(expected.repeat(2, interleave=True))
    # the places: the file's number and the row's in it, as read (the filtered rows counted)
    places = set(request[PROMPT_PLACE])
    assert (overlong != "filter") == ((0, 2) in places) == ((1, 0) in places)
    assert {f for f, _ in places} == {0, 1}


def test_image_rows_built_on_the_rank_equal_the_controllers(vlm_files):  # noqa: F811
    """The tiny VLM's shapes rows: the rank reads each row's images from the file and processes
    them with its own processor of the model, to the controller's ``ImageInputs``, bit for bit."""
    data_config = vlm_config(vlm_files, "unused").data
    model = vlm_files["model"]
    data = RLDataset.load(
        data_config.train_path, load_tokenizer(model), 128, images=image_reader(model, data_config)
    )
    indices = list(range(len(data)))[::-1]
    expected = data.collate(indices)
    request = data.requests(indices)
    assert "images" not in request and _payload(request) * 100 < _payload(expected)
    rank = RankPrompts.of_config(data_config, load_tokenizer(model), model)  # as the worker builds it
    on_rank = rank.built(from_bytes(to_bytes(request)))
    assert set(on_rank.keys()) == set(expected.keys()) and on_rank.meta == expected.meta
    for got, want in zip(on_rank["images"], expected["images"], strict=True):
        assert torch.equal(got.pixel_values, want.pixel_values)
        assert torch.equal(got.image_grid_thw, want.image_grid_thw)
    assert _columns(on_rank.select([k for k in on_rank.keys() if k != "images"])) == _columns(
        expected.select([k for k in expected.keys() if k != "images"])
    )
    group = rank.built(request.repeat(3, interleave=True))  # a group's rows, as a draw sends them
    assert group["images"][0] is group["images"][1] is group["images"][2]  # stored once, as collate's


def test_requests_without_places_pass_through_and_a_dropped_row_is_an_error(rl_files, tmp_path):
    tokenizer = load_tokenizer(rl_files["model"])
    data = RLDataset.load(_files(tmp_path), tokenizer, LIMIT)
    rank = RankPrompts(tokenizer, [data.source])
    rows = data.collate([0, 3])
    assert rank.built(rows) is rows  # collate's rows (image prompts' requests) go as they came
    assert _columns(RLDataset(data.samples).requests([0, 3])) == _columns(rows)  # not built by load
    forged = data.requests([0, 3]).assign(non_tensors={PROMPT_PLACE: [(0, 1), (0, 2)]})  # 2: filtered
    with pytest.raises(RuntimeError, match=r"a\.parquet: row 2 was dropped at load"):
        rank.built(forged)
    with pytest.raises(RuntimeError, match="no files of"):
        RankPrompts(tokenizer, []).built(data.requests([0]))


def test_a_rank_knows_the_runs_sources_from_its_config(rl_files, tmp_path):
    """The worker's sources (from ``data.*``) are the ones the controller's loads name."""
    config = small_config(rl_files, tmp_path, "data.overlong_prompts=truncate_left")
    tokenizer = load_tokenizer(rl_files["model"])
    rank = RankPrompts.of_config(config.data, tokenizer)
    for path in (config.data.train_path, config.data.val_path):
        data = RLDataset.load(path, tokenizer, config.data.max_prompt_length, "truncate_left")
        request = data.requests([1, 0])
        assert request.meta[PROMPT_SOURCE] in rank.known
        assert _columns(rank.built(request)) == _columns(data.collate([1, 0]))


def _request_bytes(monkeypatch) -> list[int]:
    """The wire bytes of each request ``generate_to_store`` gets (its rows, serialised), recorded."""
    sizes: list[int] = []
    built = RankPrompts.built

    def counted(self, requests):
        sizes.append(_payload(requests))
        return built(self, requests)

    monkeypatch.setattr(RankPrompts, "built", counted)
    return sizes


def _with_ids(monkeypatch) -> None:
    """Requests as before this module: ``collate``'s rows, ``prompt_ids`` and ``raw_prompt`` in them."""
    monkeypatch.setattr(RLDataset, "requests", lambda self, indices: self.collate(indices))


def test_in_process_grpo_on_requests_by_place_matches_requests_with_ids(rl_files, tmp_path, monkeypatch):
    """One in-process worker, two GRPO steps with the draws stored: requests naming their rows give
    the metrics of requests holding their ids, step for step, in fewer request bytes."""
    from tests.rl.test_dataplane_step import assert_equal_metrics, run

    sizes = _request_bytes(monkeypatch)
    by_place, _ = run(rl_files, tmp_path / "place", "dataplane.enabled=true")
    place_sizes = list(sizes)
    with monkeypatch.context() as patch:
        _with_ids(patch)
        with_ids, _ = run(rl_files, tmp_path / "ids", "dataplane.enabled=true")
    assert_equal_metrics(with_ids, by_place)  # and the data plane off: tests/rl/test_dataplane_step.py
    id_sizes = sizes[len(place_sizes) :]
    print(f"generation request bytes per step: with ids {id_sizes}, by place {place_sizes}")
    assert len(place_sizes) == len(id_sizes) == 2
    assert all(p < i for p, i in zip(place_sizes, id_sizes, strict=True))


@pytest.mark.slow  # three 2-step runs over 2 spawned workers: a few minutes on 2 loaded cores
def test_over_two_workers_requests_by_place_match_and_cut_the_generations_traffic(
    rl_files, tmp_path, monkeypatch
):
    """With 2 spawned workers the controller's ``batch_traffic`` in generation (request out,
    per-row scalars and texts back) drops by what the ids and messages of the request weighed;
    the metrics equal those of requests with ids and of the data plane off, step for step."""
    from tests.rl.test_dataplane_step import assert_equal_metrics, run

    on = ("trainer.n_workers=2", "dataplane.enabled=true")
    by_place, place = run(rl_files, tmp_path / "place", *on)
    with monkeypatch.context() as patch:
        _with_ids(patch)
        with_ids, ids = run(rl_files, tmp_path / "ids", *on)
    off, today = run(rl_files, tmp_path / "off", "trainer.n_workers=2", "dataplane.enabled=false")
    assert_equal_metrics(with_ids, by_place)
    assert_equal_metrics(off, by_place)
    print(
        f"controller batch bytes in generation: off {today.gen_bytes}, requests with ids "
        f"{ids.gen_bytes}, by place {place.gen_bytes}"
    )
    assert all(p < i < t for p, i, t in zip(place.gen_bytes, ids.gen_bytes, today.gen_bytes, strict=True))
