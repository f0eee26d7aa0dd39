"""Agent episodes with images: the first user turn's pictures go with every model turn, and an
episode's tokens are the engine's own for the same prompt and images."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from PIL import Image

from tandem.agents.generators import EngineGenerator, ServerGenerator
from tandem.agents.loops import AgentContext, AgentSample, run_episodes
from tandem.models import load_tokenizer
from tandem.models.chat import template_ids
from tandem.models.tiny_vlm import save_tiny_vlm
from tandem.models.vision import ImagePrompter
from tandem.protocol.generation import RolloutRequest
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, SamplingParams


def picture(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(70, 90, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def image_only_prompt(tokenizer, prompter, seed: int):
    """A user turn holding one picture: its ids and processed images."""
    return prompter.prompt(
        template_ids(tokenizer, [{"role": "user", "content": [{"type": "image"}]}], True), [picture(seed)]
    )


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return str(save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "model"))


def test_an_episode_with_images_samples_what_the_engine_does_for_the_same_prompt(vlm_dir):
    tokenizer, prompter = load_tokenizer(vlm_dir), ImagePrompter.for_model(vlm_dir)
    engine = NativeRolloutEngine.from_pretrained(
        vlm_dir, NativeEngineConfig(max_num_seqs=8, max_model_len=256)
    )
    params = SamplingParams(temperature=1.0, max_tokens=8)
    try:
        ctx = AgentContext(EngineGenerator(engine), tokenizer, params, prompter=prompter)
        messages = [{"role": "user", "content": "<image>what colour?"}]
        _, images = prompter.prompt(
            template_ids(tokenizer, [{"role": "user", "content": [{"type": "image"}]}], True), [picture(0)]
        )
        other = prompter.prompt(
            template_ids(tokenizer, [{"role": "user", "content": [{"type": "image"}]}], True), [picture(1)]
        )[1]
        trajectories = run_episodes(
            ctx, [AgentSample(messages, 5, "e0", images=images), AgentSample(messages, 5, "e1", images=other)]
        )
        parts = [{"type": "image"}, {"type": "text", "text": "what colour?"}]
        expected_prompt, _ = prompter.prompt(
            template_ids(tokenizer, [{"role": "user", "content": parts}], True), [picture(0)]
        )
        assert list(trajectories[0].prompt_ids) == expected_prompt
        direct = engine.generate_batch(
            [
                RolloutRequest(
                    "direct",
                    tuple(expected_prompt),
                    SamplingParams(temperature=1.0, max_tokens=8, seed=5),
                    images,
                )
            ]
        )[0]
    finally:
        engine.close()
    assert trajectories[0].token_ids == direct.token_ids  # same seed, same prompt, same picture
    assert trajectories[0].log_probs == pytest.approx(direct.log_probs, abs=1e-5)  # batched with e1 or alone
    assert trajectories[1].log_probs != trajectories[0].log_probs  # another picture, another episode


def test_images_need_a_vision_model_and_an_engine_in_process(vlm_dir):
    tokenizer = load_tokenizer(vlm_dir)
    images = image_only_prompt(tokenizer, ImagePrompter.for_model(vlm_dir), 2)[1]
    ctx = AgentContext(EngineGenerator(None), tokenizer, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="an agent episode has images, but the model has no vision tower"):
        ctx.prompt_ids([{"role": "user", "content": "<image>?"}], images)
    server = ServerGenerator("http://127.0.0.1:9/v1", "tiny")
    completion = asyncio.run(server.generate((1, 2), SamplingParams(max_tokens=4), "r", images))
    assert completion.finish_reason == "error" and "without images" in completion.error
