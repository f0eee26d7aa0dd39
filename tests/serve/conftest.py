"""A tiny model served on loopback, shared by the server tests."""

import json
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from tandem.models import TinyModelConfig, load_tokenizer, save_tiny_model  # noqa: E402
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine  # noqa: E402
from tandem.serve import ServerConfig, ServerThread  # noqa: E402

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("served") / "model", TinyModelConfig(family="qwen2")))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = NativeRolloutEngine.from_pretrained(
        model_dir, NativeEngineConfig(max_num_seqs=32, max_model_len=MAX_MODEL_LEN)
    )
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(engine, tokenizer):
    config = ServerConfig(port=0, model_name="tiny", max_request_bytes=64 * 1024, max_n=8)
    with ServerThread(engine, tokenizer, config) as running:
        yield running


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def http(url: str, body: dict | bytes | None = None, headers: dict | None = None, method: str | None = None):
    """``(status, parsed JSON or text)`` of one raw request (errors included, never raised)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, payload = response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        status, payload = error.code, error.read().decode()
    try:
        return status, json.loads(payload)
    except json.JSONDecodeError:
        return status, payload
