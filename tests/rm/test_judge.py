"""The LLM judge against a real ``tandem serve`` process: grades parsed from the server's own
replies, failures counted and never fatal (no answer, a hanging endpoint, no grade), and an RL
run with the judge as a reward source."""

import contextlib
import json
import re
import socket
import threading
import urllib.request

import pytest
import torch

from tandem.rl.judge_config import JudgeConfig
from tandem.rl.rewards.judge import LLMJudge
from tandem.rl.trainer import RLTrainer
from tests.rl.conftest import small_config
from tests.serve.conftest import free_port, serve_process

PATTERN = r"(\d)"  # the tiny model's greedy reply often holds a digit: its first one is the grade


@pytest.fixture(scope="module")
def judge_url(rl_files):
    port = free_port()
    with serve_process(rl_files["model"], port, "--served-model-name", "judge", env=None) as _:
        yield f"http://127.0.0.1:{port}/v1"


def ask(url, content, max_tokens):
    """The reference: one plain request to the server, as the judge should send it."""
    body = {"model": "judge", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0}  # fmt: skip
    request = urllib.request.Request(
        url + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["choices"][0]["message"]["content"]


def test_grades_are_parsed_from_the_servers_replies(judge_url):
    config = JudgeConfig(
        base_url=judge_url, prompt_template="{prompt} {response}", score_pattern=PATTERN, max_score=9.0,
        max_tokens=12, concurrency=4,
    )  # fmt: skip
    prompts = [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (10, 20), (7, 8), (44, 5), (9, 9)]]
    responses = ["3", "7", "30", "15", "49", "18"]
    result = LLMJudge(config).score(prompts, responses, ["0"] * 6)
    expected, failures = [], 0
    for prompt, response in zip(prompts, responses, strict=True):
        match = re.search(PATTERN, ask(judge_url, f"{prompt} {response}", 12))
        expected.append(float(match.group(1)) / 9.0 if match else 0.0)
        failures += match is None
    torch.testing.assert_close(result.scores, torch.tensor(expected))
    assert len(result.errors) == failures and result.retries == 0
    assert all("no grade in the judge's reply" in error for error in result.errors)
    assert LLMJudge(config).model == "judge"  # found through GET /models


def test_an_unreachable_judge_is_counted_not_fatal():
    config = JudgeConfig(base_url=f"http://127.0.0.1:{free_port()}/v1", model="judge", retries=1, timeout_s=2)
    result = LLMJudge(config).score(["1+1="] * 3, ["2"] * 3, ["2"] * 3)
    assert result.scores.tolist() == [0.0] * 3
    assert (
        len(result.errors) == 3
        and "connection failed" in result.errors[0]
        and "after 2 tries" in result.errors[0]
    )
    assert result.metrics() == {"reward/judge/errors": 3.0, "reward/judge/retries": 3.0}


@contextlib.contextmanager
def silent_server():
    """A socket that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def test_a_hanging_judge_times_out_and_is_retried():
    with silent_server() as port:
        config = JudgeConfig(base_url=f"http://127.0.0.1:{port}/v1", model="judge", retries=1, timeout_s=0.5)
        result = LLMJudge(config).score(["1+1="] * 2, ["2"] * 2, ["2"] * 2)
    assert result.scores.tolist() == [0.0, 0.0]
    assert result.retries == 2 and all("no answer within 0.5 s" in error for error in result.errors)


def test_an_rl_run_with_the_judge_as_a_reward_source(judge_url, rl_files, tmp_path):
    config = small_config(
        rl_files, tmp_path / "run", "reward.sources=[rule,judge]", "reward.weights=[1.0,0.5]",
        f"reward.judge.base_url={judge_url}", "reward.judge.prompt_template='{prompt} {response}'",
        f"reward.judge.score_pattern='{PATTERN}'", "reward.judge.max_score=9", "reward.judge.max_tokens=8",
        "trainer.val_before_train=false",
    )  # fmt: skip
    result = RLTrainer(config).fit()
    for entry in result.history:
        assert 0.0 <= entry["reward/judge/mean"] <= 1.0
        assert entry["reward/errors"] == entry["reward/judge/errors"]  # the rule never fails here
        assert "reward/rule/mean" in entry
