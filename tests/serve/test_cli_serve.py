"""``tandem serve MODEL_PATH`` as a real process: health, a chat completion with auth, clean errors."""

import os
import subprocess
import sys

import pytest

from tandem.serve import ServerConfig
from tests.serve.conftest import free_port, http, serve_process

openai = pytest.importorskip("openai")


def test_tandem_serve_process(model_dir):
    port = free_port()
    env = {**os.environ, "TANDEM_API_KEY": "k"}
    url = f"http://127.0.0.1:{port}"
    with serve_process(model_dir, port, "--max-model-len", "128", env=env) as process:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        name = os.path.basename(model_dir)
        assert [m.id for m in client.models.list().data] == [name]
        response = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
        )
        assert len(response.choices[0].token_ids) <= 5 and response.choices[0].finish_reason in (
            "stop",
            "length",
        )
        assert http(url + "/v1/models")[0] == 401
    assert f"http://127.0.0.1:{port}/v1" in process.output
    assert "native engine KV cache: 256 sequences x 128 tokens" in process.output  # the figure, said at start


def test_tandem_serve_refuses_a_context_beyond_the_models_positions(model_dir):
    command = [sys.executable, "-m", "tandem", "serve", model_dir, "--max-model-len", "100000", "--port", "1"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "max_model_len=100000 exceeds the model's max_position_embeddings=2048" in result.stderr
    assert "--max-model-len" in result.stderr and "Traceback" not in result.stderr


def test_tandem_serve_reports_a_missing_model(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "tandem", "serve", str(tmp_path / "nothing")], capture_output=True, text=True
    )
    assert result.returncode == 2 and "config.json" in result.stderr


def test_tandem_serve_refuses_a_reachable_host_without_a_key(model_dir):
    env = {key: value for key, value in os.environ.items() if key != "TANDEM_API_KEY"}
    command = [sys.executable, "-m", "tandem", "serve", model_dir, "--host", "0.0.0.0", "--port", "1"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "server.host='0.0.0.0'" in result.stderr and "--allow-unauthenticated" in result.stderr


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_hosts_need_no_key(host):
    assert ServerConfig(host=host).api_key is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "my-server.example"])
def test_reachable_hosts_need_a_key_or_an_explicit_opt_out(host):
    with pytest.raises(ValueError, match="server.api_key is unset"):
        ServerConfig(host=host)
    assert ServerConfig(host=host, api_key="k").api_key == "k"
    assert ServerConfig(host=host, allow_unauthenticated=True).allow_unauthenticated
