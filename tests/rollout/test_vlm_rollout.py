"""Vision-language models in the rollout engines, against the HF model's own full forward and
``generate``: log-probs, greedy tokens, prefix sharing keyed by the images, weight updates."""

import copy

import pytest
import torch
from PIL import Image

from tandem.engine.vision_inputs import images_key
from tandem.models import TinyModelConfig, save_tiny_model
from tandem.models.loading import load_model, load_tokenizer
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import image_token_id, load_image_processor, process_images
from tandem.protocol.images import ImageInputs
from tandem.rollout import (
    HFRolloutEngine,
    NativeEngineConfig,
    NativeRolloutEngine,
    RolloutRequest,
    SamplingParams,
)
from tandem.rollout.images import collapse_image_tokens, rebuilt_pictures
from tests.models.test_vision import picture, prompt_with_images

SAMPLE = SamplingParams(temperature=1.0, max_tokens=12)
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    return str(save_tiny_vlm(tmp_path_factory.mktemp(request.param), TinyVLMConfig(family=request.param)))


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return str(
        save_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl_only"), TinyVLMConfig(family="qwen2_vl", seed=4))
    )


@pytest.fixture(scope="module")
def reference_model(vlm_dir):
    return load_model(vlm_dir).eval()


def mixed_requests(path, params, prefix="r"):
    """One image, two images, text only, and one image again (another picture)."""
    one = prompt_with_images(path, ("red?", [picture(60, 90, 0)]))
    two = prompt_with_images(path, ("which is bigger?", [picture(112, 56, 1), picture(56, 56, 2)]))
    other = prompt_with_images(path, ("blue?", [picture(84, 84, 3)]))
    tokenizer = load_tokenizer(path)
    text = tuple(tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True)["input_ids"])  # fmt: skip
    return [
        RolloutRequest(f"{prefix}1", tuple(one[0]), params, one[1]),
        RolloutRequest(f"{prefix}2", tuple(two[0]), params, two[1]),
        RolloutRequest(f"{prefix}3", text, params),
        RolloutRequest(f"{prefix}4", tuple(other[0]), params, other[1]),
    ]


def native(path, **overrides):
    settings = {"max_num_seqs": 16, "max_model_len": 256, **overrides}
    return NativeRolloutEngine.from_pretrained(path, NativeEngineConfig(**settings))


def forward_log_probs(model, request: RolloutRequest, tokens: list[int]) -> torch.Tensor:
    """``[R]``: the log-softmax of HF's own forward at each response token: one full forward over
    prompt + response; or, for a response that sampled the image placeholder id (an ordinary token
    after the prompt's images, :func:`tandem.models.vision.image_token_mask`, which HF's full
    forward would count as one more image token than the images fill), the prompt's forward with
    its images, then the response's over that cache, the way HF's ``generate`` decodes it."""
    placeholder = image_token_id(model.config)
    if placeholder in tokens and request.images is not None:
        return cached_response_log_probs(model, request, tokens)
    input_ids = torch.tensor([list(request.prompt_ids) + tokens])
    images = {}
    if request.images is not None:
        images = {
            "pixel_values": request.images.pixel_values,
            "image_grid_thw": request.images.image_grid_thw,
        }
    with torch.no_grad():
        logits = model(
            input_ids=input_ids, mm_token_type_ids=(input_ids == placeholder).int(), **images
        ).logits[0]
    log_probs = torch.log_softmax(logits.float(), -1)[len(request.prompt_ids) - 1 : -1]
    return log_probs.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def cached_response_log_probs(model, request: RolloutRequest, tokens: list[int], prompt=None) -> torch.Tensor:
    """``[R]``: :func:`forward_log_probs` as HF decodes: the prompt with its images, then the
    response tokens as text over the prompt's cache (M-RoPE positions from its deltas).
    ``prompt``: :func:`prompt_forward` of this request's prompt, when already run (its cache is
    copied, not extended)."""
    first = prompt_forward(model, request) if prompt is None else prompt
    response = torch.tensor([tokens])
    logits = first.logits[0, -1:]  # [R, V]: the logits before each token, the first from the prompt
    if len(tokens) > 1:
        with torch.no_grad():
            rest = model(input_ids=response[:, :-1], cache=copy.deepcopy(first.cache), use_cache=True)
        logits = torch.cat([logits, rest.logits[0]])
    return torch.log_softmax(logits.float(), -1).gather(-1, response[0, :, None])[:, 0]


def prompt_forward(model, request: RolloutRequest):
    """HF's forward of ``request``'s prompt with its images, its cache kept (and the model's M-RoPE
    deltas set to this prompt's, which a continuation over the cache reads)."""
    prompt = torch.tensor([list(request.prompt_ids)])
    with torch.no_grad():
        return model(
            input_ids=prompt,
            pixel_values=request.images.pixel_values,
            image_grid_thw=request.images.image_grid_thw,
            mm_token_type_ids=(prompt == image_token_id(model.config)).int(),
            use_cache=True,
        )


def assert_log_probs_match(model, requests, completions):
    for request, completion in zip(requests, completions, strict=True):
        assert completion.finish_reason in ("stop", "length"), completion.error
        expected = forward_log_probs(model, request, completion.token_ids)
        got = torch.tensor(completion.log_probs)
        assert (got - expected).abs().max() <= 1e-5, (request.request_id, float((got - expected).abs().max()))


def test_native_sampled_log_probs_equal_the_hf_forward(vlm_dir, reference_model):
    requests = mixed_requests(vlm_dir, SAMPLE)
    engine = native(vlm_dir)
    try:
        assert engine.vision and engine.lean_decoder is None and engine.decode_graphs is None
        completions = engine.generate_batch(requests, timeout=120)
    finally:
        engine.close()
    assert sum(len(c.token_ids) for c in completions) > 20
    assert_log_probs_match(reference_model, requests, completions)


def test_hf_engine_sampled_log_probs_equal_the_hf_forward(vlm_dir, reference_model):
    requests = mixed_requests(vlm_dir, SamplingParams(temperature=1.0, max_tokens=12, seed=5))
    completions = HFRolloutEngine(reference_model, load_tokenizer(vlm_dir)).generate_batch(requests)
    assert_log_probs_match(reference_model, requests, completions)


def test_greedy_native_equals_hf_engine_and_generate(vlm_dir, reference_model):
    requests = mixed_requests(vlm_dir, GREEDY)
    engine = native(vlm_dir)
    try:
        ours = engine.generate_batch(requests, timeout=120)
    finally:
        engine.close()
    theirs = HFRolloutEngine(reference_model, load_tokenizer(vlm_dir)).generate_batch(requests)
    for request, a, b in zip(requests, ours, theirs, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, request.request_id
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-5, rtol=0)
    two = requests[1]  # HF's generate itself, with its own defaults for everything but the images
    input_ids = torch.tensor([two.prompt_ids])
    with torch.no_grad():
        generated = reference_model.generate(
            input_ids,
            pixel_values=two.images.pixel_values,
            image_grid_thw=two.images.image_grid_thw,
            mm_token_type_ids=(input_ids == image_token_id(reference_model.config)).int(),
            do_sample=False,
            max_new_tokens=GREEDY.max_tokens,
            eos_token_id=load_tokenizer(vlm_dir).eos_token_id,
        )
    assert generated[0, len(two.prompt_ids) :].tolist() == ours[1].token_ids


def same_text_two_pictures(path):
    """Two prompts with equal token ids (equal image sizes) and different pictures."""
    first = prompt_with_images(
        path, ("describe these two pictures please", [picture(112, 112, 7), picture(112, 84, 8)])
    )
    second = prompt_with_images(
        path, ("describe these two pictures please", [picture(112, 112, 9), picture(112, 84, 8)])
    )
    assert first[0] == second[0] and not torch.equal(first[1].pixel_values, second[1].pixel_values)
    return tuple(first[0]), first[1], second[1]


def test_same_text_different_images_never_share_and_a_group_shares_its_prompt(qwen2_vl_dir):
    prompt, pictures_a, pictures_b = same_text_two_pictures(qwen2_vl_dir)
    assert len(prompt) >= 48  # long enough for the decode steps to read shared prompts once
    group = [RolloutRequest(f"a{i}", prompt, SAMPLE, pictures_a) for i in range(4)]  # one ImageInputs object
    requests = [*group, RolloutRequest("b", prompt, SAMPLE, pictures_b)]
    engine = native(qwen2_vl_dir)
    try:
        completions = engine.generate_batch(requests, timeout=120)
        assert engine.stats.prefilled_tokens - sum(len(c.token_ids) for c in completions) <= 2 * len(prompt)
        # 4 copies: below the cascade's measured rule (>= 16 per prompt, shared_prefix.worth_sharing)
        assert engine.stats.shared_prefix_steps == 0
        assert len(engine._prefix) == 2 and len({key for _, key in engine._prefix}) == 2
        assert "digest" in vars(pictures_a) and "digest" in vars(pictures_b)  # each object hashed once, kept
        greedy_a, greedy_b = engine.generate_batch(
            [
                RolloutRequest("ga", prompt, GREEDY, pictures_a),
                RolloutRequest("gb", prompt, GREEDY, pictures_b),
            ]
        )
        assert engine.stats.prefix_hits == 2
    finally:
        engine.close()
    model = load_model(qwen2_vl_dir).eval()
    assert_log_probs_match(model, requests, completions)
    assert len({tuple(c.token_ids) for c in completions[:4]}) > 1  # samples of one prompt differ
    assert greedy_a.log_probs != greedy_b.log_probs
    assert_log_probs_match(model, [RolloutRequest("ga", prompt, GREEDY, pictures_a)], [greedy_a])


@pytest.mark.slow  # 33 requests and their HF references; the 4-copy test above is the fast one
def test_a_group_of_32_image_requests_decodes_its_prompt_once_and_equals_the_hf_forward(qwen2_vl_dir):
    """32 copies of one image prompt and one with other pictures: the cascade reads the group's
    prompt once per decode step (at or above shared_prefix.worth_sharing's 16 a prompt), and every
    log-prob is HF's own. With this many samples a response draws the image placeholder id (seed 0
    here: three of them), an ordinary token after the prompt's images; HF's full forward counts
    it as an image's ("Image features and image tokens do not match"), so the group's references
    decode each response over the one forward of its prompt, as HF's ``generate`` does."""
    prompt, pictures_a, pictures_b = same_text_two_pictures(qwen2_vl_dir)
    group = [RolloutRequest(f"a{i}", prompt, SAMPLE, pictures_a) for i in range(32)]
    requests = [*group, RolloutRequest("b", prompt, SAMPLE, pictures_b)]
    engine = native(qwen2_vl_dir, max_num_seqs=40)
    try:
        completions = engine.generate_batch(requests, timeout=120)
        assert engine.stats.shared_prefix_steps > 0
        assert engine.stats.prefilled_tokens - sum(len(c.token_ids) for c in completions) <= 2 * len(prompt)
    finally:
        engine.close()
    model = load_model(qwen2_vl_dir).eval()
    assert_log_probs_match(model, requests[-2:], completions[-2:])  # HF's full forward (or decode)
    shared = prompt_forward(model, group[0])  # the group's one prompt forward; each response over its cache
    for request, completion in zip(group, completions, strict=False):
        assert completion.finish_reason in ("stop", "length"), completion.error
        expected = cached_response_log_probs(model, request, completion.token_ids, shared)
        torch.testing.assert_close(torch.tensor(completion.log_probs), expected, atol=1e-5, rtol=0)


def perturbed_weights(path, scale=0.05):
    generator = torch.Generator().manual_seed(9)
    return [
        (name, tensor + scale * torch.randn(tensor.shape, generator=generator))
        for name, tensor in load_model(path).state_dict().items()
    ]


def test_a_weight_update_invalidates_cached_image_prefixes(qwen2_vl_dir):
    prompt, pictures, _ = same_text_two_pictures(qwen2_vl_dir)
    request = RolloutRequest("g", prompt, GREEDY, pictures)
    engine = native(qwen2_vl_dir)
    try:
        before = engine.generate_batch([request], timeout=60)[0]
        weights = perturbed_weights(qwen2_vl_dir)
        assert engine.update_weights(weights, version=1) == len(weights)
        after = engine.generate_batch([request], timeout=60)[0]
        assert engine.stats.prefix_hits == 0  # the v0 entry of this prompt and picture was not reused
    finally:
        engine.close()
    hf = HFRolloutEngine.from_pretrained(qwen2_vl_dir)
    hf.update_weights(weights, version=1)
    expected = hf.generate_batch([request])[0]
    assert after.token_ids == expected.token_ids and after.weight_versions == [1] * len(after.token_ids)
    torch.testing.assert_close(
        torch.tensor(after.log_probs), torch.tensor(expected.log_probs), atol=1e-5, rtol=0
    )
    assert after.log_probs != before.log_probs


def test_images_a_model_cannot_take_finish_their_request_with_an_error(qwen2_vl_dir, tmp_path):
    prompt, pictures, _ = same_text_two_pictures(qwen2_vl_dir)
    text_dir = str(save_tiny_model(tmp_path / "text", TinyModelConfig(family="qwen2")))
    text_request = RolloutRequest("img", (10, 11, 12), GREEDY, pictures)
    for engine in (native(text_dir), HFRolloutEngine.from_pretrained(text_dir)):
        try:
            bad, good = engine.generate_batch([text_request, RolloutRequest("ok", (10, 11, 12), GREEDY)])
        finally:
            engine.close()
        assert bad.finish_reason == "error" and not bad.token_ids
        assert "carries 2 images but 'qwen2' is a text-only model" in bad.error
        assert good.finish_reason in ("stop", "length") and good.token_ids
    pad = prompt.index(image_token_id(load_model(qwen2_vl_dir).config))
    short = RolloutRequest("few", prompt[:pad] + (10,) + prompt[pad + 1 :], GREEDY, pictures)
    dropped = RolloutRequest("none", prompt, GREEDY)
    for engine in (native(qwen2_vl_dir), HFRolloutEngine.from_pretrained(qwen2_vl_dir)):
        try:
            completions = engine.generate_batch(
                [short, dropped, RolloutRequest("ok", prompt, GREEDY, pictures)]
            )
        finally:
            engine.close()
        assert [c.finish_reason for c in completions[:2]] == ["error", "error"]
        assert "holds 27 <|image_pad|> tokens but its 2 images take 28" in completions[0].error
        assert "holds 28 <|image_pad|> tokens but its 0 images take 0" in completions[1].error
        assert completions[2].finish_reason in ("stop", "length")


def test_digests_tell_pictures_apart_and_are_computed_once_per_object():
    grid = torch.tensor([[1, 2, 2]])
    first = ImageInputs(torch.zeros(4, 1176), grid)
    assert first.digest is first.digest and len(first.digest) == 16  # computed once, kept with the object
    same = ImageInputs(torch.zeros(4, 1176), grid.clone())
    changed = ImageInputs(torch.zeros(4, 1176).index_fill_(1, torch.tensor([5]), 1e-7), grid)
    assert same.digest == first.digest and changed.digest != first.digest
    assert (
        images_key(None) is None
        and images_key(ImageInputs(torch.zeros(0, 1176), torch.zeros(0, 3).long())) is None
    )
    assert images_key(first) == first.digest


def test_rebuilt_pictures_give_the_same_patches_and_collapsed_prompts_expand_back(qwen2_vl_dir):
    from tandem.models.vision import expand_image_tokens

    processor = load_image_processor(qwen2_vl_dir)
    images = process_images(processor, [picture(60, 90, 0), picture(300, 200, 1), picture(56, 56, 3)])
    again = process_images(processor, [Image.fromarray(p) for p in rebuilt_pictures(images, processor)])
    assert torch.equal(again.image_grid_thw, images.image_grid_thw)
    assert torch.equal(again.pixel_values, images.pixel_values)
    ids = [1, 9, 2, 9, 9, 3]
    assert collapse_image_tokens(expand_image_tokens(ids, images, 9, 2), images, 9, 2) == ids


@pytest.mark.slow
def test_vllm_greedy_with_images_equals_the_hf_engine(qwen2_vl_dir):
    pytest.importorskip("vllm")
    from tandem.rollout.vllm_engine import VLLMEngineConfig, VLLMRolloutEngine

    requests = mixed_requests(qwen2_vl_dir, GREEDY)
    engine = VLLMRolloutEngine(qwen2_vl_dir, VLLMEngineConfig(max_model_len=256, max_num_seqs=8))
    try:
        ours = engine.generate_batch(requests, timeout=300)
    finally:
        engine.close()
    theirs = HFRolloutEngine.from_pretrained(qwen2_vl_dir).generate_batch(requests)
    for request, a, b in zip(requests, ours, theirs, strict=True):
        assert a.token_ids == b.token_ids, request.request_id
