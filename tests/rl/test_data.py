"""RL data: verl-schema parquet loading, errors that name the row and field, the arithmetic task, converters."""

import json

import pytest

from tandem.models import build_char_tokenizer
from tandem.rl.data import (
    ArithmeticTaskConfig,
    RLDataset,
    arithmetic_rows,
    gsm8k_rows,
    math_rows,
    write_parquet,
)
from tandem.sft.data import template_ids


def test_arithmetic_rows_are_correct_deterministic_and_follow_the_difficulty():
    task = ArithmeticTaskConfig(min_digits=2, max_digits=3, num_operands=3, operators="+-*")
    rows = arithmetic_rows(200, task, seed=5)
    assert rows == arithmetic_rows(200, task, seed=5)
    assert rows != arithmetic_rows(200, task, seed=6)
    for row in rows:
        expression = row["extra_info"]["expression"]
        assert row["prompt"] == [{"role": "user", "content": expression + "="}]
        # A loop reference: evaluate left to right with * first, by hand.
        terms, ops, number = [], [], ""
        for ch in expression:
            if ch.isdigit():
                number += ch
            else:
                terms.append(int(number))
                ops.append(ch)
                number = ""
        terms.append(int(number))
        assert all(10 <= t < 1000 for t in terms)
        merged, merged_ops = [terms[0]], []
        for op, t in zip(ops, terms[1:], strict=True):
            if op == "*":
                merged[-1] *= t
            else:
                merged.append(t)
                merged_ops.append(op)
        value = merged[0]
        for op, t in zip(merged_ops, merged[1:], strict=True):
            value = value + t if op == "+" else value - t
        assert row["reward_model"]["ground_truth"] == str(value)


def test_reversed_answers_are_written_units_first():
    plain = arithmetic_rows(
        50, ArithmeticTaskConfig(max_digits=3, operators="+-", allow_negative=True), seed=3
    )
    backwards = arithmetic_rows(
        50,
        ArithmeticTaskConfig(max_digits=3, operators="+-", allow_negative=True, reverse_answer=True),
        seed=3,
    )
    for a, b in zip(plain, backwards, strict=True):
        value = int(a["reward_model"]["ground_truth"])
        expected = ("-" if value < 0 else "") + str(abs(value))[::-1]
        assert b["reward_model"]["ground_truth"] == expected and b["extra_info"]["reverse_answer"]


def test_bad_difficulty_names_the_field():
    with pytest.raises(ValueError, match="task.operators"):
        ArithmeticTaskConfig(operators="/")
    with pytest.raises(ValueError, match="task.max_digits"):
        ArithmeticTaskConfig(min_digits=3, max_digits=2)


def test_dataset_tokenises_with_the_chat_template_and_filters_overlong(tmp_path):
    tokenizer = build_char_tokenizer()
    rows = arithmetic_rows(10, ArithmeticTaskConfig(), seed=0)
    rows[3]["prompt"][0]["content"] = "9" * 200  # far over the limit
    path = write_parquet(rows, tmp_path / "p.parquet")
    data = RLDataset.load(path, tokenizer, max_prompt_length=64)
    assert len(data) == 9 and data.filtered == 1
    assert data.samples[0].prompt_ids == tuple(template_ids(tokenizer, rows[0]["prompt"], True))
    batch = data.collate([0, 2])
    assert list(batch["ground_truth"]) == [
        rows[0]["reward_model"]["ground_truth"],
        rows[2]["reward_model"]["ground_truth"],
    ]
    assert list(batch["data_source"]) == ["arithmetic", "arithmetic"]
    with pytest.raises(
        ValueError, match=r"row 3: field 'prompt' is \d+ tokens, over data.max_prompt_length=64"
    ):
        RLDataset.load(path, tokenizer, max_prompt_length=64, overlong="error")


@pytest.mark.parametrize(
    ("how", "kept"),
    [
        ("truncate_left", lambda ids: ids[-20:]),
        ("truncate_right", lambda ids: ids[:20]),
        ("truncate_middle", lambda ids: ids[:10] + ids[-10:]),
    ],
)
def test_overlong_prompts_are_truncated_like_verl(tmp_path, how, kept):
    tokenizer = build_char_tokenizer()
    rows = arithmetic_rows(3, ArithmeticTaskConfig(), seed=0)
    rows[1]["prompt"][0]["content"] = "".join(str(i % 10) for i in range(60))
    path = write_parquet(rows, tmp_path / "p.parquet")
    data = RLDataset.load(path, tokenizer, max_prompt_length=20, overlong=how)
    full = list(template_ids(tokenizer, rows[1]["prompt"], True))
    assert len(data) == 3 and data.filtered == 0
    assert list(data.samples[1].prompt_ids) == kept(full) and len(full) > 20


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda r: r.pop("reward_model"), "row 2: missing field 'reward_model'"),
        (
            lambda r: r.update(reward_model=None),
            "row 2: field 'reward_model' is null; it must be a dict with 'ground_truth'",
        ),
        (lambda r: r.update(prompt=None), "row 2: field 'prompt' is null; it must be a non-empty list"),
        (lambda r: r.update(prompt="just a string"), "row 2: field 'prompt' must be a non-empty list"),
        (lambda r: r.update(prompt=[{"role": "user"}]), "row 2: field 'prompt' message 0 needs string"),
        (
            lambda r: r.update(prompt=[{"role": "human", "content": "1+1="}]),
            "message 0 has role 'human'; roles are",
        ),
        (
            lambda r: r.update(prompt=[{"role": "user", "content": " "}]),
            r"message 0 \(user\) has empty content",
        ),
        (lambda r: r.update(data_source=7), "row 2: field 'data_source' must be a string"),
        (
            lambda r: r.update(reward_model={"style": "rule"}),
            "row 2: field 'reward_model' must be a dict with 'ground_truth'",
        ),
        (lambda r: r.update(extra_info="x"), "row 2: field 'extra_info' must be a dict"),
    ],
)
def test_bad_rows_get_an_error_naming_row_and_field(tmp_path, corrupt, message):
    rows = arithmetic_rows(4, ArithmeticTaskConfig(), seed=0)
    corrupt(rows[2])
    path = tmp_path / "bad.jsonl"  # JSONL, so each row may have its own (wrong) types
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        RLDataset.load(path, build_char_tokenizer(), max_prompt_length=64)


def test_wrong_type_in_parquet_is_reported(tmp_path):
    rows = arithmetic_rows(3, ArithmeticTaskConfig(), seed=0)
    for row in rows:
        row["reward_model"]["ground_truth"] = [1, 2]  # a list, in every row (parquet needs one type)
    with pytest.raises(
        ValueError, match="row 0: field 'reward_model.ground_truth' must be a string or number"
    ):
        RLDataset.load(write_parquet(rows, tmp_path / "t.parquet"), build_char_tokenizer(), 64)


def test_gsm8k_and_math_converters(tmp_path):
    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text(json.dumps({"question": "2 apples and 3 more?", "answer": "2+3=5\n#### 1,005"}) + "\n")
    (row,) = gsm8k_rows(gsm)
    assert row["reward_model"]["ground_truth"] == "1005" and row["data_source"] == "openai/gsm8k"
    assert row["prompt"][0]["content"].startswith("2 apples and 3 more?")
    math = tmp_path / "math.jsonl"
    math.write_text(
        json.dumps({"problem": "Simplify 2/4.", "solution": "It is $\\boxed{\\frac{1}{2}}$."}) + "\n"
    )
    (row,) = math_rows(math)
    assert row["reward_model"]["ground_truth"] == "\\frac{1}{2}"
    gsm.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="row 0: field 'answer' has no '#### <answer>' line"):
        gsm8k_rows(gsm)
