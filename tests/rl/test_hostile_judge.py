"""The LLM judge against hostile endpoints: real HTTP servers on 127.0.0.1 (``http.server`` in a
thread) that redirect to another origin, send too much, drip bytes, cut the body short or give
grades off the scale. Each such reply scores 0 and counts in ``reward/judge/errors``; the run
goes on, the key never leaves the configured origin, and an honest reply of the same shape is
the reference that still scores."""

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from tandem.rl.judge_config import JudgeConfig
from tandem.rl.rewards.judge import LLMJudge

KEY = "sk-judge-secret-0123"
ITEMS = 2


def chat_reply(content: str) -> bytes:
    """An OpenAI chat-completion reply whose message is ``content``."""
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


@contextlib.contextmanager
def judge_server(answer):
    """A real HTTP server in a thread; ``answer(handler)`` writes each reply. Yields its ``/v1``
    URL and the ``(method, path, headers)`` of every request it received."""
    seen = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def answer_any(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append((self.command, self.path, dict(self.headers)))
            self.close_connection = True
            with contextlib.suppress(OSError):  # the judge hung up on it
                answer(self)

        do_GET = do_POST = answer_any

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def send(handler, body: bytes, status: int = 200, framing: str = "length", headers=()) -> None:
    """Writes one reply, its body framed by Content-Length, chunks, or the connection's close."""
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    for name, value in headers:
        handler.send_header(name, value)
    if framing == "length":
        handler.send_header("Content-Length", str(len(body)))
    elif framing == "chunked":
        handler.send_header("Transfer-Encoding", "chunked")
    handler.end_headers()
    if framing == "chunked":
        for start in range(0, len(body), 4096):
            piece = body[start : start + 4096]
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        handler.wfile.write(b"0\r\n\r\n")
    else:
        handler.wfile.write(body)


def grade(url: str, **overrides):
    """``LLMJudge.score`` of ``ITEMS`` items with the key set, no retries unless overridden."""
    fields = {"base_url": url, "model": "judge", "api_key": KEY, "retries": 0, "timeout_s": 5.0, **overrides}
    return LLMJudge(JudgeConfig(**fields)).score(["1+1="] * ITEMS, ["2"] * ITEMS, ["2"] * ITEMS)


def assert_all_failed(result, reason: str) -> None:
    """Every item scored 0, failed for ``reason`` and counted in ``reward/judge/errors``."""
    assert result.scores.tolist() == [0.0] * ITEMS
    assert len(result.errors) == ITEMS and all(reason in error for error in result.errors), result.errors
    assert result.metrics()["reward/judge/errors"] == ITEMS


def test_the_reference_an_honest_judge_gets_the_key_and_its_grade_is_used():
    with judge_server(lambda handler: send(handler, chat_reply("Score: 7"))) as (url, seen):
        result = grade(url)
    torch.testing.assert_close(result.scores, torch.full((ITEMS,), 0.7))
    assert result.errors == [] and len(seen) == ITEMS
    assert all(headers["Authorization"] == f"Bearer {KEY}" for _, _, headers in seen)


@pytest.mark.parametrize("model", ["judge", ""])  # "": the model is found through GET /models
@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_origin_is_refused_and_never_sees_the_key(status, model):
    def elsewhere(handler):
        listing = json.dumps({"data": [{"id": "other"}]}).encode()
        send(handler, listing if handler.path.endswith("/models") else chat_reply("Score: 10"))

    with judge_server(elsewhere) as (other_url, other_seen):

        def redirect(handler):
            target = other_url + handler.path.removeprefix("/v1")
            send(handler, b"{}", status=status, headers=[("Location", target)])

        with judge_server(redirect) as (url, seen):
            result = grade(url, model=model)
    assert other_seen == []  # neither the key nor the task reached the other origin
    assert_all_failed(result, "redirect")
    assert len(seen) == (1 if model == "" else ITEMS)  # a redirect is not retried


@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_a_reply_over_the_size_cap_is_a_judge_error(framing):
    honest = chat_reply("Score: 10")
    cap = len(honest)
    with judge_server(lambda handler: send(handler, honest, framing=framing)) as (url, _):
        at_cap = grade(url, max_response_bytes=cap)
    with judge_server(lambda handler: send(handler, honest + b" ", framing=framing)) as (url, _):
        over_cap = grade(url, max_response_bytes=cap)
    assert at_cap.scores.tolist() == [1.0] * ITEMS and at_cap.errors == []
    assert_all_failed(over_cap, "max_response_bytes")


def test_the_default_cap_refuses_a_reply_of_two_mebibytes():
    huge = chat_reply("Score: 10" + " " * (2 << 20))
    with judge_server(lambda handler: send(handler, huge, framing="close")) as (url, _):
        result = grade(url)
    assert_all_failed(result, "max_response_bytes")
    assert JudgeConfig().max_response_bytes == 1 << 20


def drip(handler, where: str) -> None:
    """A reply written one byte every 0.1 s, from its status line or from its body."""
    body = chat_reply("Score: 10")
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    if where == "body":
        handler.wfile.write(head)
        handler.wfile.flush()
    sent = head + body if where == "headers" else body
    for byte in sent:
        handler.wfile.write(bytes([byte]))
        handler.wfile.flush()
        time.sleep(0.1)


@pytest.mark.parametrize("where", ["headers", "body"])
def test_one_deadline_holds_for_the_whole_request_against_a_dripping_server(where):
    with judge_server(lambda handler: drip(handler, where)) as (url, _):
        start = time.monotonic()
        result = grade(url, timeout_s=0.5)
        elapsed = time.monotonic() - start
    assert_all_failed(result, "no answer within 0.5 s")
    assert elapsed < 2.0  # each byte arrives within 0.5 s; the whole reply would take ~10 s


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_body_cut_short_is_a_judge_error_and_retried(framing):
    def cut_short(handler):
        body = chat_reply("Score: 10")
        if framing == "length":
            send(handler, b"", headers=[("Content-Length", str(len(body)))], framing="none")
        else:
            send(handler, b"", headers=[("Transfer-Encoding", "chunked")], framing="none")
            handler.wfile.write(b"%x\r\n" % len(body))
        handler.wfile.write(body[: len(body) // 2])

    with judge_server(cut_short) as (url, seen):
        result = grade(url, retries=1)
    assert_all_failed(result, "cut short")
    assert all("after 2 tries" in error for error in result.errors) and len(seen) == 2 * ITEMS


ANY_TOKEN = r"Score: (\S+)"


@pytest.mark.parametrize(
    ("reply", "pattern", "expected"),
    [
        ("Score: 0", ANY_TOKEN, 0.0),
        ("Score: 10", ANY_TOKEN, 1.0),
        ("Score: 7.5", ANY_TOKEN, 0.75),
        ("Score: 7", JudgeConfig.score_pattern, 0.7),
    ],
)
def test_the_reference_grades_on_the_scale_are_used(reply, pattern, expected):
    with judge_server(lambda handler: send(handler, chat_reply(reply))) as (url, _):
        result = grade(url, score_pattern=pattern)
    torch.testing.assert_close(result.scores, torch.full((ITEMS,), expected))
    assert result.errors == []


@pytest.mark.parametrize(
    ("reply", "pattern"),
    [
        ("Score: 11", ANY_TOKEN),
        ("Score: -1", ANY_TOKEN),
        ("Score: 10.001", ANY_TOKEN),
        ("Score: " + "9" * 400, JudgeConfig.score_pattern),
        ("Score: 1e999", ANY_TOKEN),
        ("Score: nan", ANY_TOKEN),
        ("Score: inf", ANY_TOKEN),
        ("Score: -inf", ANY_TOKEN),
        ("Score: ten", ANY_TOKEN),
    ],
)
def test_a_grade_off_the_scale_or_not_finite_is_a_judge_error(reply, pattern):
    with judge_server(lambda handler: send(handler, chat_reply(reply))) as (url, _):
        result = grade(url, score_pattern=pattern)
    assert_all_failed(result, "grade")
    assert torch.isfinite(result.scores).all()


def test_min_score_widens_the_scale_below_zero():
    with judge_server(lambda handler: send(handler, chat_reply("Score: -3"))) as (url, _):
        widened = grade(url, min_score=-5.0)
        default = grade(url)
    torch.testing.assert_close(widened.scores, torch.full((ITEMS,), -0.3))
    assert widened.errors == []
    assert_all_failed(default, "grade")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"max_response_bytes": 0}, "reward.judge.max_response_bytes"),
        ({"min_score": 10.0}, "reward.judge.min_score"),
        ({"base_url": "ftp://127.0.0.1/v1"}, "reward.judge.base_url"),
        ({"base_url": "http:///v1"}, "reward.judge.base_url"),
    ],
)
def test_config_errors_name_the_field(fields, named):
    with pytest.raises(ValueError, match=named):
        JudgeConfig(**fields)
