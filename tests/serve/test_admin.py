"""Admin endpoints: pause/resume, weight updates from a directory (also mid-stream), sleep/wake."""

import threading
import time

import pytest

from tandem.models import TinyModelConfig, save_tiny_model
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tests.serve.conftest import http

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory):
    """The same architecture with different weights (another seed), as an HF directory."""
    return str(
        save_tiny_model(tmp_path_factory.mktemp("next") / "model", TinyModelConfig(family="qwen2", seed=7))
    )


def greedy_ids(client, prompt="weights?", max_tokens=12):
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    return response.choices[0]


def test_update_weights_from_a_directory(server, client, other_weights, tokenizer):
    before = greedy_ids(client)
    code, body = http(server.url + "/admin/update_weights", {"path": other_weights})
    assert code == 200 and body["version"] == 1 and body["tensors"] > 0
    assert http(server.url + "/admin/weight_version") == (200, {"version": 1})
    after = greedy_ids(client)
    reference = NativeRolloutEngine.from_pretrained(
        other_weights, NativeEngineConfig(max_num_seqs=2, max_model_len=128)
    )
    try:
        prompt = tuple(tokenizer.encode("weights?", add_special_tokens=False))
        expected = reference.generate_batch(
            [RolloutRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
        )[0]
    finally:
        reference.close()
    assert after.token_ids == expected.token_ids != before.token_ids
    assert after.weight_versions == [1] * 12 and before.weight_versions == [0] * 12
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).weight_version == 1


def test_bad_weight_updates_are_refused(server, tmp_path):
    url = server.url + "/admin/update_weights"
    version = http(server.url + "/admin/weight_version")[1]["version"]
    code, body = http(url, {"path": str(tmp_path / "missing")})
    assert code == 400 and "missing" in body["error"]["message"]
    code, body = http(url, {"path": str(tmp_path), "version": version})
    assert code == 409 and "increase" in body["error"]["message"]
    small = save_tiny_model(
        tmp_path / "small", TinyModelConfig(family="qwen2", hidden_size=32, num_heads=2, num_kv_heads=1)
    )
    code, body = http(url, {"path": str(small)})
    assert code == 400 and "shape" in body["error"]["message"]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "model.safetensors").write_bytes(b"\xff" * 64)  # not a safetensors file
    code, body = http(url, {"path": str(corrupt)})
    assert code == 400 and body["error"]["param"] == "path" and str(corrupt) in body["error"]["message"], body
    assert http(server.url + "/admin/weight_version")[1]["version"] == version  # nothing changed


def test_update_mid_stream_keeps_the_request_and_switches_versions(server, client, engine, other_weights):
    """pause(keep) → update → resume while a stream runs: it continues, later tokens carry the new version."""
    engine.pause("keep")
    stream = client.completions.create(
        model="tiny",
        prompt="long",
        max_tokens=60,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    versions = []
    released = threading.Timer(0.2, engine.resume)
    released.start()
    while len(versions) < 3:  # a few tokens under the current weights
        versions += next(chunks).choices[0].weight_versions
    engine.pause("keep")  # freeze generation, then update through the API (which pauses/resumes itself)
    current = engine.version
    code, body = http(server.url + "/admin/update_weights", {"path": other_weights, "version": current + 5})
    assert code == 200
    engine.resume()
    for chunk in chunks:
        if chunk.choices:
            versions += chunk.choices[0].weight_versions
    assert len(versions) == 60
    switch = versions.index(current + 5)
    assert set(versions[:switch]) == {current} and set(versions[switch:]) == {current + 5}


def test_pause_resume_sleep_wake(server, client, engine):
    assert http(server.url + "/admin/pause", {"mode": "keep"}) == (200, {"paused": True, "mode": "keep"})
    assert engine.metrics().paused
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", greedy_ids(client, max_tokens=4)))
    worker.start()
    time.sleep(0.3)
    assert "r" not in result and engine.num_waiting == 1  # queued while paused
    assert http(server.url + "/admin/resume", {})[0] == 200
    worker.join(timeout=30)
    assert len(result["r"].token_ids) == 4
    assert http(server.url + "/admin/pause", {"mode": "sideways"})[0] == 400
    before = greedy_ids(client)
    assert http(server.url + "/admin/sleep", {}) == (200, {"asleep": True})
    assert engine.metrics().asleep
    assert http(server.url + "/admin/wake", {}) == (200, {"asleep": False})
    assert http(server.url + "/admin/reset_prefix_cache", {}) == (200, {"reset": True})
    assert greedy_ids(client).token_ids == before.token_ids
