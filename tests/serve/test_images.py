"""``image_url`` content parts: a vision-language model answers over HTTP exactly as the engine does
when handed the same images, and every bad image is a 400 naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tandem.models import load_tokenizer
from tandem.models.chat import template_ids
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import ImagePrompter
from tandem.protocol.generation import RolloutRequest, SamplingParams
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine
from tandem.serve import ServerConfig, ServerThread

from .conftest import http


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(url: str, parts: list[dict], **fields):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 6,
        "temperature": 0,
    }
    return http(url + "/v1/chat/completions", {**body, **fields})


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return str(save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model", TinyVLMConfig()))


@pytest.fixture(scope="module")
def vlm_server(vlm_dir):
    engine = NativeRolloutEngine.from_pretrained(
        vlm_dir, NativeEngineConfig(max_num_seqs=8, max_model_len=256)
    )
    prompter = ImagePrompter.for_model(vlm_dir)
    config = ServerConfig(port=0, model_name="tiny", max_images_per_request=2, max_image_pixels=300 * 300)
    with ServerThread(engine, load_tokenizer(vlm_dir), config, prompter) as running:
        yield running, engine, prompter
    engine.close()


def test_image_url_answers_as_the_engine_does_with_the_same_images(vlm_server, vlm_dir):
    server, engine, prompter = vlm_server
    pictures = [png(60, 90, 0), png(112, 112, 1)]
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(pictures[0])}},
        {"type": "text", "text": "which?"},
        {"type": "image_url", "image_url": {"url": data_url(pictures[1])}},
    ]
    status, body = chat(server.url, parts, logprobs=True)
    assert status == 200, body
    tokenizer = load_tokenizer(vlm_dir)
    content = [{"type": "image"}, {"type": "text", "text": "which?"}, {"type": "image"}]
    ids = template_ids(tokenizer, [{"role": "user", "content": content}], add_generation_prompt=True)
    decoded = [Image.open(io.BytesIO(raw)).convert("RGB") for raw in pictures]
    prompt, images = prompter.prompt(ids, decoded)
    direct = engine.generate_batch(
        [RolloutRequest("direct", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=6), images)]
    )[0]
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(
        direct.token_ids, skip_special_tokens=True
    )
    served = [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]]
    assert served == pytest.approx(direct.log_probs, abs=1e-6)
    assert body["usage"]["prompt_tokens"] == len(prompt)

    # the images are read: other pictures, same text, another prompt computation
    swapped = [parts[2], parts[1], parts[0]]
    status, other = chat(server.url, swapped, logprobs=True)
    assert status == 200
    assert [e["logprob"] for e in other["choices"][0]["logprobs"]["content"]] != served


@pytest.mark.parametrize(
    ("url", "mentions"),
    [
        ("https://example.com/cat.png", "never fetched"),
        ("file:///etc/passwd", "never fetched"),
        ("data:image/png;base64,%%%", "not valid base64"),
        ("data:image/png;base64," + base64.b64encode(b"not a picture").decode(), "not an image"),
        (data_url(png(400, 400, 3)), "over server.max_image_pixels=90000"),
        (data_url(png(2, 500, 6)), "the model's image processor refuses this 500x2 image"),  # aspect ratio 250
    ],
)
def test_bad_images_are_400s_naming_the_part(vlm_server, url, mentions):
    server, _, _ = vlm_server
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": url}}]
    status, body = chat(server.url, parts)
    assert status == 400, body
    assert mentions in body["error"]["message"]
    assert body["error"]["param"] == "messages.0.content.1.image_url"


def test_too_many_images(vlm_server):
    server, _, _ = vlm_server
    part = {"type": "image_url", "image_url": {"url": data_url(png(56, 56, 4))}}
    status, body = chat(server.url, [part, part, part])
    assert status == 400 and "3 images in one request; at most 2" in body["error"]["message"]
    assert body["error"]["param"] == "messages.0.content.2.image_url"


def test_a_text_model_refuses_images(server):
    part = {"type": "image_url", "image_url": {"url": data_url(png(56, 56, 5))}}
    status, body = chat(server.url, [{"type": "text", "text": "hi"}, part])
    assert status == 400 and "takes no images" in body["error"]["message"]
    assert body["error"]["param"] == "messages.0.content.1.image_url"


@pytest.fixture(scope="module")
def budget_server(vlm_server, vlm_dir):
    """The same engine behind limits a test can reach: 60000 decoded pixels per request, one
    request decoding images at a time."""
    _, engine, prompter = vlm_server
    config = ServerConfig(
        port=0,
        model_name="tiny",
        max_image_pixels=300 * 300,
        max_request_image_pixels=60000,
        max_image_requests=1,
    )
    with ServerThread(engine, load_tokenizer(vlm_dir), config, prompter) as running:
        yield running


def test_decoded_pixels_per_request_are_bounded(budget_server):
    first = {"type": "image_url", "image_url": {"url": data_url(png(200, 200, 6))}}  # 40000 pixels
    status, body = chat(
        budget_server.url, [first, {"type": "image_url", "image_url": {"url": data_url(png(100, 200, 7))}}]
    )
    assert status == 200, body  # 40000 + 20000 = the limit exactly
    second = {"type": "image_url", "image_url": {"url": data_url(png(120, 200, 8))}}  # 24000 more: over
    status, body = chat(budget_server.url, [first, second])
    assert status == 400, body
    message = body["error"]["message"]
    assert (
        "24000 pixels" in message
        and "the 20000 pixels left of server.max_request_image_pixels=60000" in message
    )
    assert body["error"]["param"] == "messages.0.content.1.image_url"


def test_requests_decoding_images_at_once_are_bounded(budget_server):
    part = {"type": "image_url", "image_url": {"url": data_url(png(56, 56, 9))}}
    slots = budget_server.app.state.image_slots
    assert slots.acquire(blocking=False)  # the one slot, as a request decoding its images holds it
    try:
        status, body = chat(budget_server.url, [part])
        assert status == 429, body
        assert "server.max_image_requests" in body["error"]["message"]
        text_status, _ = chat(budget_server.url, [{"type": "text", "text": "hi"}])
        assert text_status == 200  # requests without images are not bounded by it
    finally:
        slots.release()
    status, body = chat(budget_server.url, [part])
    assert status == 200, body  # the slot is free again
    assert slots.acquire(blocking=False)  # and the request gave its slot back
    slots.release()
