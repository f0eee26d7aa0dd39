"""Bad input gets a 4xx with a message and the server keeps serving; auth; timeouts; disconnects."""

import json
import time
import urllib.request

import pytest

from tandem.serve import ServerConfig, ServerThread
from tests.serve.conftest import MAX_MODEL_LEN, http

openai = pytest.importorskip("openai")

GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0}


@pytest.mark.parametrize(
    ("change", "status", "mentions"),
    [
        ({"model": "gpt-9"}, 404, "gpt-9"),
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": MAX_MODEL_LEN}, 400, "context"),
        ({"prompt": "x" * MAX_MODEL_LEN}, 400, "context"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": [5, 10**6]}, 400, "unknown token ids"),
        ({"prompt": [[1, 2], []]}, 400, "empty"),
        ({"prompt": None}, 400, "prompt"),
        ({"n": 9}, 400, "server.max_n"),
        ({"echo": True}, 400, "echo"),
        ({"logprobs": 5}, 400, "logprobs"),
        ({"frequency_penalty": 0.5}, 400, "penalt"),
        ({"stop_token_ids": [-1]}, 400, "stop_token_ids"),
        ({"stream": True, "prompt": [10**6]}, 400, "unknown token ids"),
        ({"prompt": "\ud800"}, 400, "prompt"),
        ({"prompt": ["ok", "a\udfffb"]}, 400, "prompt.1"),
        ({"stop": ["\ud800"]}, 400, "stop.0"),
        ({"max_tokens": True}, 400, "max_tokens"),
        ({"max_tokens": 2.0}, 400, "max_tokens"),
        ({"n": True}, 400, "n"),
        ({"seed": False}, 400, "seed"),
        ({"temperature": True}, 400, "temperature"),
        ({"stream": "yes"}, 400, "stream"),
        ({"prompt": [True, 5]}, 400, "prompt"),
        ({"stop": [""]}, 400, "stop"),
        ({"stop": ""}, 400, "stop"),
        ({"stop": ["x", ""]}, 400, "stop"),
    ],
)
def test_bad_completion_requests_are_4xx_naming_the_problem(server, change, status, mentions):
    code, body = http(server.url + "/v1/completions", {**GOOD, **change})
    assert code == status, body
    assert mentions in body["error"]["message"] + str(body["error"]["param"])
    assert http(server.url + "/v1/completions", GOOD)[0] == 200  # still serving


@pytest.mark.parametrize(
    ("url", "change", "param"),
    [
        ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
        ("/v1/completions", {"max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"stop": [""]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
            "max_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ],
    ids=[
        "surrogate",
        "bool-max-tokens",
        "empty-stop",
        "chat-surrogate",
        "chat-bool-max-tokens",
        "chat-empty-stop",
    ],
)
def test_invalid_text_bools_and_empty_stops_are_openai_style_400s_naming_the_field(
    server, url, change, param
):
    """Refused before anything runs, in OpenAI's error shape, with the field in ``param``: the same
    answer a client gets for any other invalid field (not a plain-text 500, not 1 token, not a
    stop after the first token)."""
    code, body = http(server.url + url, {**{k: v for k, v in GOOD.items() if k != "prompt"}, **change})
    assert code == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    assert body["error"]["param"] == param and param in body["error"]["message"], body


def test_a_stop_string_still_cuts_the_text_where_it_appears(server):
    """The reference for the empty-stop refusal: a real stop string ends the text just before it."""
    full = http(server.url + "/v1/completions", {**GOOD, "max_tokens": 12, "ignore_eos": True})[1]
    text = full["choices"][0]["text"]
    stop = text[3:5]
    code, cut = http(
        server.url + "/v1/completions", {**GOOD, "max_tokens": 12, "ignore_eos": True, "stop": [stop]}
    )
    assert code == 200 and cut["choices"][0]["text"] == text[: text.index(stop)]


def test_bad_chat_requests(server):
    url = server.url + "/v1/chat/completions"
    assert http(url, {"model": "tiny", "messages": []})[0] == 400
    assert http(url, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]})[0] == 400
    assert (
        http(url, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3})[0]
        == 400
    )
    code, body = http(url, {"model": "tiny", "messages": [{"role": "user", "content": "é"}]})
    assert code == 400 and "template" in body["error"]["message"]  # the character tokenizer has no "é"


def test_malformed_and_oversize_bodies(server):
    url = server.url + "/v1/completions"
    code, body = http(url, b"{not json")
    assert code == 400 and "JSON" in body["error"]["message"]
    code, body = http(url, b"[1, 2]")
    assert code == 400
    code, body = http(url, {**GOOD, "prompt": "a" * 70_000})
    assert code == 413 and "max_request_bytes" in body["error"]["message"]
    assert http(server.url + "/v1/nowhere", GOOD)[0] == 404
    assert http(url, GOOD)[0] == 200


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 200}], max_tokens=2
        )


def test_bearer_token(engine, tokenizer):
    config = ServerConfig(port=0, model_name="tiny", api_key="s3cret")
    with ServerThread(engine, tokenizer, config) as server:
        url = server.url + "/v1/completions"
        code, body = http(url, GOOD)
        assert code == 401 and "API key" in body["error"]["message"]
        assert http(url, GOOD, {"Authorization": "Bearer wrong"})[0] == 401
        assert http(server.url + "/admin/weight_version", headers={"Authorization": "Bearer wrong"})[0] == 401
        assert http(server.url + "/health")[0] == 200  # probes stay open
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_timeout_aborts_the_request(engine, tokenizer):
    """A paused engine cannot finish: the request gets 408 in time and leaves the queue."""
    config = ServerConfig(port=0, model_name="tiny", request_timeout_s=0.5)
    with ServerThread(engine, tokenizer, config) as server:
        engine.pause("keep")
        try:
            started = time.monotonic()
            code, body = http(server.url + "/v1/completions", GOOD)
            assert code == 408 and "0.5 s" in body["error"]["message"]
            assert time.monotonic() - started < 5
            assert engine.num_waiting == 0 and engine.num_running == 0
        finally:
            engine.resume()
        assert http(server.url + "/v1/completions", GOOD)[0] == 200


def test_client_disconnect_aborts_a_stream(server, engine):
    before = engine.metrics().finished.get("abort", 0)
    body = {**GOOD, "max_tokens": 100, "stream": True, "ignore_eos": True}
    request = urllib.request.Request(
        server.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    engine.pause("keep")  # hold the request in flight while the client walks away
    try:
        response = urllib.request.urlopen(request, timeout=30)  # headers come before any token
        response.close()
        deadline = time.monotonic() + 30
        while engine.metrics().finished.get("abort", 0) == before:
            assert time.monotonic() < deadline, "the abandoned request was never aborted"
            time.sleep(0.05)
    finally:
        engine.resume()
    assert engine.num_running == 0 and engine.num_waiting == 0
