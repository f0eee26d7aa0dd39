"""Hostile clients against one real ``tandem serve`` process: each is refused quickly (4xx) or
aborted, and ``/health``, probed from another connection meanwhile, keeps answering in < 100 ms
(< 0.5 s beside the stalled stream, whose 16 long choices keep both cores busy).

The server's list of hostile requests: a client-supplied chat template, a huge ``n`` x prompts
fan-out, a tiny temperature, out-of-range seeds, a ``/metrics`` label injection and a flood of
404 paths, a non-ASCII bearer token, a 1 MB prompt, a non-streaming client that disconnects and
a streaming client that stops reading.
"""

import contextlib
import http.client
import json
import os
import re
import socket
import threading
import time

import pytest

from tests.serve.conftest import free_port, serve_process

KEY = "k"
MAX_MODEL_LEN = 2048
MAX_SEQUENCES = 16
HEALTH_BUDGET_S = 0.1
STREAM_SEND_TIMEOUT_S = 1.0
# While 16 long choices decode beside it, /health shares 2 busy cores with the engine (0.28 s was
# seen on CI); a loop that waited on the stalled client would hold it for the whole send timeout.
STALLED_STREAM_HEALTH_BUDGET_S = STREAM_SEND_TIMEOUT_S / 2
FAST_S = 5.0  # a refusal must come well within this, even on busy cores
# a Jinja template quadratic in its loop bound: seconds of CPU for a 150-byte request
NESTED_LOOPS = "{% for i in range(30000) %}{% for j in range(30000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def port(model_dir):
    port = free_port()
    flags = [
        "--served-model-name", "tiny",
        "--api-key", KEY,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_SEQUENCES),
        "--max-sequences-per-request", str(MAX_SEQUENCES),
        "--stream-send-timeout", str(STREAM_SEND_TIMEOUT_S),
    ]  # fmt: skip
    env = {key: value for key, value in os.environ.items() if key != "TANDEM_API_KEY"}
    with serve_process(model_dir, port, *flags, env=env):
        call("POST", port, "/v1/completions", {"model": "tiny", "prompt": "warm", "max_tokens": 2})
        yield port


def call(method: str, port: int, path: str, body=None, headers=None, timeout: float = 30.0):
    """``(status, parsed JSON or text, seconds)`` of one request on a fresh connection (auth by default)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    payload = None if body is None else json.dumps(body)
    started = time.monotonic()
    try:
        connection.request(
            method,
            path,
            payload,
            {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **(headers or {})},
        )
        response = connection.getresponse()
        text = response.read().decode()
    finally:
        connection.close()
    elapsed = time.monotonic() - started
    try:
        return response.status, json.loads(text), elapsed
    except json.JSONDecodeError:
        return response.status, text, elapsed


@contextlib.contextmanager
def health_probe(port: int, budget_s: float = HEALTH_BUDGET_S):
    """Probe ``/health`` from its own thread and connection while the block runs; yields the latencies.

    Every answer must come within ``budget_s``.
    """
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        while not stop.is_set():
            started = time.monotonic()
            connection.request("GET", "/health")
            assert connection.getresponse().read()
            latencies.append(time.monotonic() - started)
            stop.wait(0.01)
        connection.close()

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    time.sleep(0.03)
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(timeout=30)
    assert latencies and max(latencies) < budget_s, f"/health took {max(latencies, default=0):.3f} s"


SAMPLE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*"'
    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*)\} (?P<value>-?[0-9.e+-]+|NaN|[+-]Inf)'
)
COMMENT = re.compile(r"# (HELP [a-zA-Z_:][a-zA-Z0-9_:]* .*|TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (gauge|counter))")


def metrics(port: int) -> dict[str, float]:
    """``/metrics`` parsed strictly by the Prometheus text format: ``{'name{labels}': value}``."""
    status, text, _ = call("GET", port, "/metrics")
    assert status == 200 and text.endswith("\n")
    samples: dict[str, float] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("#"):
            assert COMMENT.fullmatch(line), f"malformed comment line {line!r}"
            typed.add(line.split()[2])
            continue
        match = SAMPLE.fullmatch(line)
        assert match, f"malformed sample line {line!r}"
        assert match["name"] in typed, f"sample {match['name']} has no # TYPE"
        key = f"{match['name']}{{{match['labels']}}}"
        assert key not in samples, f"duplicate series {key}"
        samples[key] = float(match["value"])
    return samples


def finished(port: int, reason: str) -> float:
    return metrics(port).get(f'tandem_requests_finished_total{{model="tiny",reason="{reason}"}}', 0.0)


def chat(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}


def completion(**extra) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **extra}


def test_a_client_chat_template_is_refused_without_rendering_it(port):
    with health_probe(port):
        status, body, elapsed = call(
            "POST", port, "/v1/chat/completions", chat(chat_template_kwargs={"chat_template": NESTED_LOOPS})
        )
    assert status == 400 and elapsed < FAST_S, (status, body, elapsed)
    assert body["error"]["param"] == "chat_template_kwargs.chat_template"
    assert "chat_template_kwargs.chat_template" in body["error"]["message"]
    status, body, _ = call("POST", port, "/v1/chat/completions", chat(chat_template=NESTED_LOOPS))
    assert status == 400 and body["error"]["param"] == "chat_template"
    # other template arguments still reach the model's own template
    status, body, _ = call(
        "POST", port, "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": False})
    )
    assert status == 200 and len(body["choices"][0]["token_ids"]) <= 2


def test_fan_out_over_the_limit_is_refused(port):
    prompts = [[5, 6, 7]] * 8
    with health_probe(port):
        status, body, elapsed = call("POST", port, "/v1/completions", completion(prompt=prompts, n=4))
    assert status == 400 and elapsed < FAST_S, (status, body)
    assert body["error"]["param"] == "n" and "max_sequences_per_request" in body["error"]["message"]
    assert "32 sequences" in body["error"]["message"]
    status, body, _ = call("POST", port, "/v1/completions", completion(prompt=prompts, n=2))  # at the limit
    assert status == 200 and len(body["choices"]) == MAX_SEQUENCES


def test_a_tiny_temperature_samples_greedily(port):
    request = completion(max_tokens=8, ignore_eos=True)
    with health_probe(port):
        status, tiny, _ = call("POST", port, "/v1/completions", {**request, "temperature": 1e-40})
    assert status == 200, tiny
    status, greedy, _ = call("POST", port, "/v1/completions", {**request, "temperature": 0})
    assert status == 200 and tiny["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
    assert len(greedy["choices"][0]["token_ids"]) == 8


@pytest.mark.parametrize("seed", [-1, 2**63, 10**30])
def test_an_out_of_range_seed_is_a_400_naming_it(port, seed):
    status, body, elapsed = call("POST", port, "/v1/completions", completion(seed=seed))
    assert status == 400 and body["error"]["param"] == "seed" and elapsed < FAST_S, body
    assert "seed" in body["error"]["message"]


def test_the_largest_seed_is_served(port):
    assert call("POST", port, "/v1/completions", completion(seed=2**63 - 1, temperature=1.0))[0] == 200


def test_metrics_resist_label_injection_and_path_floods(port):
    injected = "/v1/%22%7D%201%0Afake_series%7Bx%3D%22y"  # decodes to '/v1/"} 1\nfake_series{x="y'
    assert call("GET", port, injected)[0] == 404
    metrics(port)  # its own series (/metrics, 200) exists from here on
    before = metrics(port)
    with health_probe(port):
        for i in range(40):
            assert call("GET", port, f"/nowhere/{i}")[0] == 404
    after = metrics(port)
    assert not any("fake_series" in key for key in after)
    assert set(after) == set(before)  # 40 new paths, no new series
    unmatched = 'tandem_http_requests_total{route="unmatched",status="404"}'
    assert after[unmatched] == before[unmatched] + 40
    assert after['tandem_http_requests_total{route="/v1/completions",status="200"}'] >= 1


@pytest.mark.parametrize("token", ["ключ".encode(), "é".encode("latin-1"), b"\xff\xfe"])
def test_a_non_ascii_bearer_token_is_a_401(port, token):
    status, body, _ = call("GET", port, "/v1/models", headers={"Authorization": b"Bearer " + token})
    assert status == 401 and "API key" in body["error"]["message"]


def test_a_megabyte_prompt_is_refused_without_stalling_the_server(port):
    for path, body in [
        ("/v1/completions", completion(prompt="a" * 1_000_000)),
        ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a" * 1_000_000}])),
    ]:
        with health_probe(port):
            status, answer, elapsed = call("POST", port, path, body)
        assert status == 400 and "context" in answer["error"]["message"] and elapsed < FAST_S, answer


def raw_request(port: int, body: dict, receive_buffer: int | None = None) -> socket.socket:
    """A connection that sent ``body`` to ``/v1/completions`` and reads nothing yet."""
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def wait_for_abort(port: int, aborted_before: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while finished(port, "abort") == aborted_before:
        assert time.monotonic() < deadline, "the abandoned request was never aborted"
        time.sleep(0.1)


LONG = completion(max_tokens=MAX_MODEL_LEN - 8, ignore_eos=True, temperature=1.0)  # seconds of generation


def test_a_non_streaming_client_that_disconnects_is_aborted(port):
    aborted, lengths = finished(port, "abort"), finished(port, "length")
    sock = raw_request(port, LONG)
    time.sleep(0.5)  # generating now, tokens flowing
    sock.close()
    with health_probe(port):
        wait_for_abort(port, aborted)
    assert finished(port, "length") == lengths  # it did not run to the end
    assert metrics(port)['tandem_requests_running{model="tiny"}'] == 0


def test_a_streaming_client_that_stops_reading_is_aborted(port):
    aborted, lengths = finished(port, "abort"), finished(port, "length")
    # 16 choices of ~2k tokens, ~350 bytes a token: more than loopback's socket buffers can hold
    stream = {**LONG, "stream": True, "logprobs": 1, "n": MAX_SEQUENCES}
    sock = raw_request(port, stream, receive_buffer=4096)
    try:
        assert sock.recv(1024).startswith(b"HTTP/1.1 200")  # then never read again
        with health_probe(port, STALLED_STREAM_HEALTH_BUDGET_S):
            wait_for_abort(port, aborted)
        assert finished(port, "length") == lengths
    finally:
        sock.close()
