"""A tiny model served on loopback, shared by the server tests."""

import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(model_dir: str, port: int, *flags: str, env: dict) -> Iterator[subprocess.Popen]:
    """A real ``tandem serve model_dir --port port *flags`` process, yielded once ``/health`` answers
    200; terminated on exit, then its output (stdout and stderr) is in ``process.output``.

    The output goes to a file, not a pipe: a full pipe would stall a chatty server mid-test."""
    command = [sys.executable, "-m", "tandem", "serve", model_dir, "--port", str(port), *flags]
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

        def output() -> str:
            log.seek(0)
            return log.read()

        deadline = time.monotonic() + 120
        try:
            while True:
                assert process.poll() is None, output()
                with contextlib.suppress(OSError):
                    if http(f"http://127.0.0.1:{port}/health")[0] == 200:
                        break
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
            yield process
        finally:
            process.terminate()
            process.wait(timeout=30)
            process.output = output()
