"""Bad JSONL bytes and text are refused naming the file, the line, the row and the byte or field,
through the loaders the trainers use (RL prompts, SFT, DPO) and through ``tandem sft``."""

from __future__ import annotations

import json
import re

import pytest

from tandem.cli import main
from tandem.data.rows import read_rows
from tandem.dpo.data import PreferenceDataConfig, PreferenceDataset
from tandem.models import build_char_tokenizer, save_tiny_model
from tandem.rl.data import RLDataset
from tandem.sft import SFTDataConfig, SFTDataset

RL_ROW = {
    "data_source": "x",
    "prompt": [{"role": "user", "content": "1+1="}],
    "reward_model": {"ground_truth": "2"},
}
SFT_ROW = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("rows") / "model"))


def with_surrogate(row: dict) -> str:
    """``row`` as one JSON line whose first user message holds a lone ``\\ud800`` (as json.dumps writes it)."""
    line = json.dumps(row)
    return line.replace("1+1=", "1+\\ud800=", 1)


def jsonl(path, lines: list[str | bytes]):
    path.write_bytes(b"".join((line if isinstance(line, bytes) else line.encode()) + b"\n" for line in lines))
    return path


def test_a_lone_surrogate_is_named_by_file_line_row_and_field_in_rl_and_sft(tmp_path):
    tokenizer = build_char_tokenizer()
    good = json.dumps(RL_ROW)
    path = jsonl(tmp_path / "rl.jsonl", [good, "", with_surrogate(RL_ROW)])  # a blank line: row 1 is line 3
    expected = re.escape(
        f"{path}: line 3 (row 1): field 'prompt[0].content' holds a lone surrogate \\ud800 at character 2"
    )
    with pytest.raises(ValueError, match=expected):
        RLDataset.load(path, tokenizer, 64, "error")
    path = jsonl(tmp_path / "sft.jsonl", [with_surrogate(SFT_ROW)])
    with pytest.raises(ValueError, match=re.escape(f"{path}: line 1 (row 0): field 'messages[0].content'")):
        SFTDataset.load(path, tokenizer, SFTDataConfig())
    # a surrogate pair is one character and loads: the check refuses only what is not text
    pair = json.dumps(RL_ROW).replace("1+1=", "\\ud83d\\ude00 1+1=")
    rows = read_rows(jsonl(tmp_path / "pair.jsonl", [pair]))
    assert rows[0]["prompt"][0]["content"] == "\U0001f600 1+1="


def test_invalid_utf8_is_named_by_file_line_and_byte_in_dpo(tmp_path):
    row = {"prompt": [{"role": "user", "content": "hi"}], "chosen": "yes", "rejected": "no"}
    line = json.dumps(row).encode().replace(b"hi", b"h\xffi")
    path = jsonl(tmp_path / "pairs.jsonl", [json.dumps(row), line])
    column = line.index(b"\xff") + 1
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: line 2: byte {column} (b'\\xff') is not valid UTF-8")
    ):
        PreferenceDataset.load(path, build_char_tokenizer(), PreferenceDataConfig())
    # the same bytes as Python's reader sees them: read_text fails without naming the file
    with pytest.raises(UnicodeDecodeError):
        path.read_text()


@pytest.mark.parametrize("bad", ["surrogate", "utf8"])
def test_tandem_sft_reports_the_file_and_row_in_one_line(tmp_path, capsys, bad, tiny_model_dir):
    line = (
        with_surrogate(SFT_ROW)
        if bad == "surrogate"
        else json.dumps(SFT_ROW).encode().replace(b"1+1", b"1\xc3+1")
    )
    path = jsonl(tmp_path / "train.jsonl", [json.dumps(SFT_ROW), line])
    code = main(
        [
            "sft",
            f"model_path={tiny_model_dir}",
            f"data.train_path={path}",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"tandem sft: error: {path}: line 2")
    assert (
        "(row 1): field 'messages[0].content' holds a lone surrogate"
        if bad == "surrogate"
        else "is not valid UTF-8"
    ) in err


def test_tandem_train_reports_a_lone_surrogate_in_one_line(rl_files, tmp_path, capsys):
    rows = read_rows(rl_files["train"])[:2]
    lines = [json.dumps(rows[0]), json.dumps(rows[1]).replace('"content": "', '"content": "\\udfff', 1)]
    path = jsonl(tmp_path / "train.jsonl", lines)
    settings = [
        f"model_path={rl_files['model']}",
        f"data.train_path={path}",
        f"data.val_path={rl_files['val']}",
    ]
    code = main(
        [
            "train",
            *settings,
            f"reward.custom_path={rl_files['reward']}",
            f"trainer.output_dir={tmp_path / 'out'}",
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith(f"tandem train: error: {path}: line 2 (row 1): field 'prompt[")
    assert "holds a lone surrogate \\udfff at character 0" in err
