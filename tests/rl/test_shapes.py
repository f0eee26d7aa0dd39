"""``tandem prepare-data shapes``: the pictures show what the ground truths say, the files load
through the RL dataset, the answers are balanced (chance levels), and the ``shapes`` scorer."""

from __future__ import annotations

import io
from collections import Counter

import pytest
from PIL import Image

from tandem.cli import main
from tandem.models.loading import load_tokenizer
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.rl.config import RLDataConfig
from tandem.rl.data import RLDataset, image_reader
from tandem.rl.data.shapes import ANSWERS, BACKGROUND, COLOURS, QUESTIONS, shapes_rows
from tandem.rl.rewards.scorers import SCORERS, one_word_answer


def reference_answer(kind: str, shapes: list[dict]) -> str:
    """The answer read off the scene written in ``extra_info``, independently of the generator."""
    if kind == "count":
        return str(len([s for s in shapes if s["colour"] == "red"]))
    if kind == "largest":
        sizes = sorted((s["size"] for s in shapes), reverse=True)
        assert len(sizes) == 1 or sizes[0] >= sizes[1] * 1.5  # clearly the largest
        return next(s["colour"] for s in shapes if s["size"] == sizes[0])
    circles = [s for s in shapes if s["kind"] == "circle"]
    if kind == "has_circle":
        return "yes" if circles else "no"
    squares = [s for s in shapes if s["kind"] == "square"]
    assert len(circles) == len(squares) == 1
    return "yes" if circles[0]["x"] < squares[0]["x"] else "no"


def test_prepare_data_shapes_writes_files_that_load_and_show_their_answers(tmp_path):
    out = tmp_path / "shapes"
    assert main(["prepare-data", "shapes", "--out", str(out), "--train-size", "48", "--test-size", "8"]) == 0
    model = save_tiny_vlm(tmp_path / "vlm", TinyVLMConfig())
    data = RLDataset.load(
        out / "train.parquet",
        load_tokenizer(model),
        256,
        "error",
        images=image_reader(model, RLDataConfig(train_path=str(out / "train.parquet"))),
    )
    assert len(data) == 48
    assert all(s.images.image_grid_thw.tolist() == [[1, 8, 8]] for s in data.samples)  # 16 image tokens
    rows = shapes_rows(48, 0)
    for sample, row in zip(data.samples, rows, strict=True):
        kind, shapes = sample.extra_info["question"], sample.extra_info["scene"]
        assert sample.data_source == "shapes" and sample.ground_truth == reference_answer(kind, shapes)
        assert QUESTIONS[kind] in sample.raw_prompt[0]["content"]
        picture = Image.open(io.BytesIO(row["images"][0]["bytes"])).convert("RGB")
        for shape in shapes:  # each shape's centre shows its colour
            assert picture.getpixel((shape["x"], shape["y"])) == COLOURS[shape["colour"]]
        corners = [(0, 0), (111, 0), (0, 111), (111, 111), (55, 55), (56, 56), (56, 20), (20, 56)]
        assert all(picture.getpixel(corner) == BACKGROUND for corner in corners)  # shapes keep apart


def test_shapes_are_deterministic_by_seed_and_never_overlap():
    assert shapes_rows(20, 3) == shapes_rows(20, 3)
    assert shapes_rows(20, 3) != shapes_rows(20, 4)
    assert shapes_rows(5, 3, split="test") != shapes_rows(5, 3, split="train")
    for row in shapes_rows(300, 1, canvas=168):
        shapes = row["extra_info"]["scene"]
        quadrants = {(s["x"] >= 84, s["y"] >= 84) for s in shapes}
        assert len(quadrants) == len(shapes) and 1 <= len(shapes) <= 4
        assert all(28 <= s["size"] <= 84 for s in shapes)  # at least one 28-pixel block, within its quadrant


def test_chance_levels_of_each_question_kind():
    """Answers are drawn uniformly per kind: guessing the commonest answer scores about
    1/4 (count, largest) and 1/2 (has_circle, left_of), 3/8 over all four kinds; the demo's
    two kinds alone, 1/4."""
    rows = shapes_rows(3000, 0)
    by_kind: dict[str, Counter] = {kind: Counter() for kind in QUESTIONS}
    for row in rows:
        by_kind[row["extra_info"]["question"]][row["reward_model"]["ground_truth"]] += 1
    majority = {kind: max(c.values()) / sum(c.values()) for kind, c in by_kind.items()}
    print({kind: round(rate, 3) for kind, rate in majority.items()})
    for kind, counts in by_kind.items():
        assert set(counts) == set(ANSWERS[kind])
        assert majority[kind] == pytest.approx(1 / len(ANSWERS[kind]), abs=0.04)
        assert sum(counts.values()) / len(rows) == pytest.approx(1 / len(QUESTIONS), abs=0.04)
    overall = sum(max(c.values()) for c in by_kind.values()) / len(rows)
    assert overall < 0.41
    demo = shapes_rows(2000, 0, questions=("count", "largest"))
    assert {row["extra_info"]["question"] for row in demo} == {"count", "largest"}
    with pytest.raises(ValueError, match="questions must be some of"):
        shapes_rows(4, 0, questions=("colour",))


@pytest.mark.parametrize(
    "reply, truth, score",
    [
        ("2", "2", 1.0),
        ("Two.", "2", 1.0),
        ("  Blue!\n", "blue", 1.0),
        ("Let me look.\nyes", "yes", 1.0),
        ("yes, it is", "yes", 1.0),
        ("no", "yes", 0.0),
        ("red and blue", "blue", 0.0),
        ("", "red", 0.0),
    ],
)
def test_the_shapes_scorer_matches_the_one_word_answer(reply, truth, score):
    assert SCORERS.get("shapes")(reply, truth, {}) == score
    assert one_word_answer(reply) == one_word_answer(reply.upper())  # case does not matter
