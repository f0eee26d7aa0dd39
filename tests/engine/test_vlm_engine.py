"""The training engine on vision-language models against references: the HF model's own forward,
padded against packed, shared prompts against unshared, two processes against one."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText

from tandem.controller import ResourcePool, create_worker_group
from tandem.engine import EngineConfig, LoraConfig, TorchTrainEngine
from tandem.engine.shared_prompts import pack_shared_prompts, prompt_groups
from tandem.engine.vision_model import vision_blocks
from tandem.models.loading import load_tokenizer
from tandem.models.tiny_vlm import TinyVLMConfig, save_tiny_vlm
from tandem.models.vision import (
    expand_image_tokens,
    image_token_id,
    load_image_processor,
    merge_size,
    process_images,
)
from tandem.protocol import Batch
from tandem.sft.loss import sft_loss
from tests.engine.workers import EngineWorker

RESPONSE_WIDTH = 6


def picture(height: int, width: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm_dir(request, tmp_path_factory):
    return str(save_tiny_vlm(tmp_path_factory.mktemp(request.param), TinyVLMConfig(family=request.param)))


@pytest.fixture(scope="module")
def qwen2_vl_dir(tmp_path_factory):
    return str(save_tiny_vlm(tmp_path_factory.mktemp("qwen2_vl"), TinyVLMConfig(family="qwen2_vl")))


def load_vlm(path: str):
    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def prompt(path: str, text: str, pictures: list[Image.Image]):
    """A user turn's token ids (images first, placeholders expanded) and its images (None: text)."""
    tokenizer = load_tokenizer(path)
    content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if not pictures:
        return ids, None
    images = process_images(load_image_processor(path), pictures)
    config = load_vlm(path).config
    return expand_image_tokens(ids, images, image_token_id(config), merge_size(config)), images


def vlm_batch(path: str, prompts: list, response_lengths: list[int], seed: int = 0) -> Batch:
    """Rows of ``prompts`` (``(ids, images)``, left-padded) and random responses of
    ``response_lengths`` tokens (right-padded), as a rollout batch lays them out."""
    gen = torch.Generator().manual_seed(seed)
    width = max(len(ids) for ids, _ in prompts)
    rows = len(prompts)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for row, (ids, _) in enumerate(prompts):
        prompt_ids[row, width - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, width - len(ids) :] = 1
    response_mask = (torch.arange(RESPONSE_WIDTH) < torch.tensor(response_lengths)[:, None]).long()
    responses = torch.randint(6, 100, (rows, RESPONSE_WIDTH), generator=gen) * response_mask
    return Batch(
        {
            "prompts": prompt_ids,
            "responses": responses,
            "input_ids": torch.cat([prompt_ids, responses], 1),
            "attention_mask": torch.cat([prompt_mask, response_mask], 1),
            "loss_mask": torch.cat([torch.zeros_like(prompt_mask), response_mask], 1),
            "weights": torch.randn(rows, width + RESPONSE_WIDTH, generator=gen),
        },
        non_tensors={"images": [images for _, images in prompts]},
    )


def mixed_prompts(path: str) -> list:
    """One image, two images of other sizes, text only, and the first image again with other text."""
    first = picture(60, 90, 0)
    return [
        prompt(path, "red?", [first]),
        prompt(path, "which one", [picture(112, 56, 1), picture(56, 56, 2)]),
        prompt(path, "hello there", []),
        prompt(path, "blue", [first]),
    ]


def hf_reference(model, ids: list[int], images) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF model's own forward on one unpadded sequence: each token's log-prob (from the one
    before it) and the entropy of that prediction, ``[L - 1]`` each."""
    input_ids = torch.tensor([ids])
    extra = {}
    if images is not None:
        extra = {
            "pixel_values": images.pixel_values,
            "image_grid_thw": images.image_grid_thw,
            "mm_token_type_ids": (input_ids == image_token_id(model.config)).int(),
        }
    with torch.no_grad():
        logits = model(input_ids=input_ids, **extra).logits[0, :-1].double()
    log_softmax = logits.log_softmax(-1)
    log_probs = log_softmax.gather(-1, input_ids[0, 1:, None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs.float(), entropy.float()


def make_engine(path: str, **overrides) -> TorchTrainEngine:
    settings = {"model_path": path, "lr": 1e-3, "pad_tokens_to_multiple": 16, **overrides}
    engine = TorchTrainEngine(EngineConfig(**settings))
    engine.initialize()
    return engine


def weighted_loss(micro: Batch, outputs):
    """A loss that reaches every log-prob and entropy of the rows' valid tokens with its own weight."""
    mask = micro["loss_mask"]
    loss = ((outputs.log_probs * micro["weights"] + 0.1 * outputs.entropy) * mask).sum() / 10
    return loss, {}


def loss_and_grads(engine: TorchTrainEngine, batch: Batch):
    result = engine.forward_backward(batch, weighted_loss)
    grads = {name: p.grad.clone() for name, p in engine.causal_lm.named_parameters() if p.grad is not None}
    engine.zero_grad()
    return result.loss, grads


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_log_probs_and_entropy_equal_the_hf_forward(vlm_dir, packing):
    prompts = mixed_prompts(vlm_dir)
    batch = vlm_batch(vlm_dir, prompts, [6, 3, 5, 0])
    engine = make_engine(vlm_dir, use_packing=packing, share_prompts=False, micro_batch_size=3)
    outputs = engine.forward_backward(batch, None, forward_only=True).outputs
    model = load_vlm(vlm_dir)
    mask = batch["attention_mask"].bool()
    for row, (_, images) in enumerate(prompts):
        ids = batch["input_ids"][row][mask[row]].tolist()
        log_probs, entropy = hf_reference(model, ids, images)
        torch.testing.assert_close(outputs.log_probs[row][mask[row]][1:], log_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(outputs.entropy[row][mask[row]][1:], entropy, atol=1e-5, rtol=0)


def test_a_text_only_forward_runs_the_vision_tower_for_nothing(qwen2_vl_dir):
    """Without images the vision tower still runs (on a blank image) and every vision parameter
    gets a zero gradient, which DDP's and FSDP2's collectives need; the log-probs are the HF
    model's own."""
    prompts = [prompt(qwen2_vl_dir, "hello there", []), prompt(qwen2_vl_dir, "hi", [])]
    batch = vlm_batch(qwen2_vl_dir, prompts, [6, 3])
    engine = make_engine(qwen2_vl_dir, share_prompts=False)
    outputs = engine.forward_backward(batch, None, forward_only=True).outputs
    model, mask = load_vlm(qwen2_vl_dir), batch["attention_mask"].bool()
    for row, (_, images) in enumerate(prompts):
        log_probs, _ = hf_reference(model, batch["input_ids"][row][mask[row]].tolist(), images)
        torch.testing.assert_close(outputs.log_probs[row][mask[row]][1:], log_probs, atol=1e-5, rtol=0)
    for step in (
        lambda: engine.forward_backward(batch, weighted_loss),
        lambda: engine._empty_pass(batch, False),
    ):
        step()
        vision = {name: p.grad for name, p in engine.causal_lm.named_parameters() if ".visual." in name}
        assert vision and all(grad is not None and not grad.any() for grad in vision.values())
        engine.zero_grad()
    assert len(vision_blocks(engine.causal_lm)) == TinyVLMConfig().vision_depth


def test_packed_equals_padded_loss_and_every_gradient(qwen2_vl_dir):
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 2], seed=1)
    padded_loss, padded = loss_and_grads(make_engine(qwen2_vl_dir, use_packing=False), batch)
    packed_loss, packed = loss_and_grads(
        make_engine(qwen2_vl_dir, share_prompts=False, max_tokens_per_micro_batch=64), batch
    )
    assert abs(packed_loss - padded_loss) < 1e-5
    assert any(".visual." in name for name in padded) and padded.keys() == packed.keys()
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_gradient_checkpointing_changes_no_gradient(qwen2_vl_dir):
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 2], seed=2)
    plain_loss, plain = loss_and_grads(make_engine(qwen2_vl_dir), batch)
    engine = make_engine(qwen2_vl_dir, gradient_checkpointing=True)
    engine.causal_lm.train()  # HF checkpoints only in training mode
    checkpointed_loss, checkpointed = loss_and_grads(engine, batch)
    assert abs(checkpointed_loss - plain_loss) < 1e-6
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_shared_prompts_equal_unshared_and_other_images_are_not_shared(qwen2_vl_dir):
    first, other = picture(60, 90, 0), picture(60, 90, 3)
    one = prompt(qwen2_vl_dir, "red?", [first])
    copy = (one[0], type(one[1])(one[1].pixel_values.clone(), one[1].image_grid_thw.clone()))
    same_text_other_image = prompt(qwen2_vl_dir, "red?", [other])
    text = prompt(qwen2_vl_dir, "hello", [])
    # rows 0, 1, 4 share prompt and images (row 4 an equal copy); row 2 has the same text and
    # placeholders but another image of the same size; row 3 is text only, its twin row 5 too
    assert same_text_other_image[0] == one[0]
    prompts = [one, one, same_text_other_image, text, copy, text]
    batch = vlm_batch(qwen2_vl_dir, prompts, [6, 4, 5, 3, 2, 6], seed=3)
    width = batch["prompts"].shape[1]
    groups = prompt_groups(batch["input_ids"], batch["attention_mask"], width, batch["images"])
    assert groups == [[0, 1, 4], [2], [3, 5]]
    packed = pack_shared_prompts(batch["input_ids"], batch["attention_mask"], width, batch["images"])
    prompt_tokens = batch["attention_mask"][:, :width].sum(-1)
    assert packed.num_tokens == int(prompt_tokens[[0, 2, 3]].sum() + batch["attention_mask"][:, width:].sum())

    unshared_loss, unshared = loss_and_grads(make_engine(qwen2_vl_dir, share_prompts=False), batch)
    shared_engine = make_engine(qwen2_vl_dir, share_prompts=True)
    shared_loss, shared = loss_and_grads(shared_engine, batch)
    plain = make_engine(qwen2_vl_dir, share_prompts=False).forward_backward(batch, None, forward_only=True)
    sharing = shared_engine.forward_backward(batch, None, forward_only=True)
    response = batch["attention_mask"][:, width:].bool()
    for field in ("log_probs", "entropy"):
        expected = getattr(plain.outputs, field)[:, width:][response]
        torch.testing.assert_close(
            getattr(sharing.outputs, field)[:, width:][response], expected, atol=1e-5, rtol=0
        )
    assert abs(shared_loss - unshared_loss) < 1e-5
    for name, grad in unshared.items():
        torch.testing.assert_close(shared[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_freeze_vision_tower_trains_the_language_model_only(qwen2_vl_dir):
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 2], seed=4)
    engine = make_engine(qwen2_vl_dir, freeze_vision_tower=True, lr=1e-2)
    before = {name: p.detach().clone() for name, p in engine.causal_lm.named_parameters()}
    trained = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    engine.forward_backward(batch, weighted_loss)
    for name, param in engine.causal_lm.named_parameters():
        vision = ".visual." in name
        assert param.requires_grad is not vision and (id(param) in trained) is not vision, name
        assert (param.grad is None) is vision, name
    engine.optimizer_step()
    for name, param in engine.causal_lm.named_parameters():
        moved = not torch.equal(param.detach(), before[name])
        assert moved is (".visual." not in name) or name.endswith("embed_tokens.weight"), name


def test_checkpoint_resume_equals_uninterrupted(qwen2_vl_dir, tmp_path):
    batches = [vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 2], seed=s) for s in (5, 6)]

    def step(engine, batch):
        engine.forward_backward(batch, weighted_loss)
        engine.optimizer_step()

    uninterrupted = make_engine(qwen2_vl_dir)
    for batch in batches:
        step(uninterrupted, batch)
    first = make_engine(qwen2_vl_dir)
    step(first, batches[0])
    first.save(str(tmp_path / "ckpt"))
    resumed = make_engine(qwen2_vl_dir)
    resumed.load(str(tmp_path / "ckpt"))
    step(resumed, batches[1])
    expected = dict(uninterrupted.iter_parameters())
    for name, tensor in resumed.iter_parameters():
        assert torch.equal(tensor, expected[name]), name


def test_lora_trains_the_language_model_and_the_export_loads(qwen2_vl_dir, tmp_path):
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 2], seed=7)
    engine = make_engine(qwen2_vl_dir, lora=LoraConfig(rank=8, alpha=16), lr=5e-3, share_prompts=False)
    adapted = [name for name, p in engine.causal_lm.named_parameters() if p.requires_grad]
    assert adapted and all(".lora_" in name and ".visual." not in name for name in adapted)
    loss = functools.partial(sft_loss, normalizer=engine.global_normalizer(batch["loss_mask"]))
    losses = []
    for _ in range(4):
        losses.append(engine.forward_backward(batch, loss).loss)
        engine.optimizer_step()
    assert all(later < earlier for earlier, later in zip(losses[:-1], losses[1:], strict=True)), losses
    assert losses[-1] < losses[0] - 0.1, losses
    policy = engine.forward_backward(batch, None, forward_only=True).outputs.log_probs

    engine.export_hf(str(tmp_path / "export"), load_tokenizer(qwen2_vl_dir), write=True)
    exported = load_vlm(str(tmp_path / "export"))
    assert AutoImageProcessor.from_pretrained(str(tmp_path / "export")) is not None
    mask = batch["attention_mask"].bool()
    for row, images in enumerate(batch["images"]):
        log_probs, _ = hf_reference(exported, batch["input_ids"][row][mask[row]].tolist(), images)
        torch.testing.assert_close(policy[row][mask[row]][1:], log_probs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(  # sequence parallelism composes: tests/engine/test_vlm_sp.py
    "overrides,key",
    [
        (
            {"tp_size": 2},
            r"engine.tp_size=2 with a vision-language model \(.*\): tensor parallelism does not split",
        ),
        (
            {"head": "value"},
            r"engine.head='value' with a vision-language model \(.*\): value and reward heads",
        ),
    ],
)
def test_what_does_not_compose_is_refused(qwen2_vl_dir, overrides, key):
    engine = TorchTrainEngine(EngineConfig(model_path=qwen2_vl_dir, **overrides))
    with pytest.raises(ValueError, match=key):
        engine.initialize()


def test_images_for_a_text_model_are_refused(tiny_model_dir, qwen2_vl_dir):
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir)[:1], [3])
    with pytest.raises(ValueError, match="row 0 of the batch has images"):
        make_engine(tiny_model_dir).forward_backward(batch, None, forward_only=True)


def test_placeholders_must_cover_the_images(qwen2_vl_dir):
    ids, images = prompt(qwen2_vl_dir, "red?", [picture(60, 90, 0)])
    placeholder = image_token_id(load_vlm(qwen2_vl_dir).config)
    short = list(ids)
    short.remove(placeholder)
    batch = vlm_batch(qwen2_vl_dir, [(short, images), (ids, images)], [3, 3])
    with pytest.raises(ValueError, match="row 0 holds 5 image placeholder tokens but its images"):
        make_engine(qwen2_vl_dir).forward_backward(batch, None, forward_only=True)


def test_a_placeholder_a_response_sampled_is_an_ordinary_token(qwen2_vl_dir):
    """Rows whose responses hold the placeholder id (a policy may sample it): packed equals
    padded, and the prompts' log-probs are still HF's own."""
    prompts = mixed_prompts(qwen2_vl_dir)
    batch = vlm_batch(qwen2_vl_dir, prompts, [6, 3, 5, 2], seed=2)
    placeholder = image_token_id(load_vlm(qwen2_vl_dir).config)
    responses = batch["responses"].clone()
    responses[0, 1] = responses[2, 0] = placeholder  # after an image prompt, and in a text-only row
    width = batch["prompts"].shape[1]
    batch = batch.assign(
        tensors={"responses": responses, "input_ids": torch.cat([batch["prompts"], responses], 1)}
    )
    padded_loss, padded = loss_and_grads(make_engine(qwen2_vl_dir, use_packing=False), batch)
    packed_loss, packed = loss_and_grads(make_engine(qwen2_vl_dir, max_tokens_per_micro_batch=64), batch)
    assert abs(packed_loss - padded_loss) < 1e-5
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    engine = make_engine(qwen2_vl_dir, share_prompts=False)  # every row's prompt tokens predicted
    outputs = engine.forward_backward(batch, None, forward_only=True).outputs
    for row, (ids, images) in enumerate(prompts):
        reference, _ = hf_reference(load_vlm(qwen2_vl_dir), ids, images)
        start = width - len(ids)
        torch.testing.assert_close(outputs.log_probs[row, start + 1 : width], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "strategy,overrides",
    [
        ("fsdp2", {}),
        pytest.param("ddp", {}, marks=pytest.mark.slow),
        pytest.param(
            "fsdp2", {"freeze_vision_tower": True, "gradient_checkpointing": True}, marks=pytest.mark.slow
        ),
    ],
    ids=["fsdp2", "ddp", "fsdp2-frozen-tower-checkpointed"],
)
def test_two_process_step_equals_single_process(qwen2_vl_dir, strategy, overrides):
    """Rank 0's rows hold images, rank 1's first row is text only; a row takes a micro-batch of its
    own (31 to 47 tokens): the vision tower's units and gradients stay in step on both ranks."""
    batch = vlm_batch(qwen2_vl_dir, mixed_prompts(qwen2_vl_dir), [6, 3, 5, 2], seed=8)
    base = EngineConfig(
        model_path=qwen2_vl_dir, lr=1e-2, eps=1e-3, max_tokens_per_micro_batch=50, **overrides
    )
    outputs = {}
    for world, config in ((1, base), (2, EngineConfig(**{**base.__dict__, "strategy": strategy}))):
        with create_worker_group(
            EngineWorker, ResourcePool((world,)), "process", kwargs={"config": config}
        ) as group:
            outputs[world] = (group.train_step(batch), group.parameters()[0])
    (single_out, single_params), (dp_out, dp_params) = outputs[1], outputs[2]
    torch.testing.assert_close(dp_out["log_probs"], single_out["log_probs"], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dp_out["grad_norm"], single_out["grad_norm"], atol=1e-6, rtol=1e-5)
    assert any(".visual.blocks." in name for name in single_params)
    loaded = load_vlm(qwen2_vl_dir).state_dict()
    for name, tensor in single_params.items():
        torch.testing.assert_close(dp_params[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
        if ".visual." in name:  # the tower trains unless frozen
            assert torch.equal(tensor, loaded[name]) is bool(overrides), name
