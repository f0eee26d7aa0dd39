"""From API request bodies to engine inputs: prompt token ids and ``SamplingParams``."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from tandem.data.images import ImageError, decode_data_url
from tandem.models.chat_literal import literal_template_ids
from tandem.models.vision import ImagePrompter, process_images
from tandem.protocol.generation import SamplingParams
from tandem.protocol.images import ImageInputs
from tandem.serve.config import ServerConfig
from tandem.serve.errors import APIError
from tandem.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

GREEDY_BELOW_TEMPERATURE = 1e-5  # smaller temperatures sample greedily (documented in docs/serve.md)


def split_prompts(body: CompletionRequest, max_prompts: int) -> list[str | list[int]]:
    """The prompts of a completion request as given (text or token ids), before any tokenizing."""
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt is empty", "prompt")
    if len(prompts) > max_prompts:
        raise APIError(400, f"{len(prompts)} prompts in one request; at most {max_prompts}", "prompt")
    return prompts


def tokenize_prompts(prompts: list[str | list[int]], tokenizer) -> list[list[int]]:
    """The token ids of each prompt (text is tokenized without special tokens); CPU-bound, run off the event loop."""
    ids = [tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in prompts]
    if any(not p for p in ids):
        raise APIError(400, "a prompt is empty", "prompt")
    return ids


def chat_prompt(
    body: ChatCompletionRequest,
    tokenizer,
    prompter: ImagePrompter | None = None,
    config: ServerConfig | None = None,
    image_slots: threading.Semaphore | None = None,
) -> tuple[list[int], ImageInputs | None]:
    """The model's chat template applied to the messages (with ``tools`` and ``chat_template_kwargs``),
    and the images of their ``image_url`` parts (``data:`` URLs, decoded and processed by the
    vision-language model's ``prompter``; ids expanded to one placeholder per image token).

    Special-token strings typed in the messages stay plain text unless
    ``server.special_tokens_in_text=control``. A request with images holds one of
    ``image_slots`` (``server.max_image_requests`` of them) while its images are decoded and
    processed; with none free it is answered 429.

    CPU-bound (Jinja rendering, tokenizing, decoding images): run it off the event loop. The
    request must have passed :func:`~tandem.serve.schemas.unsupported_fields`, which refuses a
    client template.
    """
    config = config or ServerConfig()
    with _image_slot(body, image_slots, config):
        return _rendered(body, tokenizer, prompter, config)


@contextlib.contextmanager
def _image_slot(
    body: ChatCompletionRequest, slots: threading.Semaphore | None, config: ServerConfig
) -> Iterator[None]:
    """Hold one of ``slots`` when the request has images (429 when none is free); else nothing."""
    if slots is None or not any(True for message in body.messages for _ in message.image_parts()):
        yield
        return
    if not slots.acquire(blocking=False):
        raise APIError(
            429,
            f"{config.max_image_requests} requests are already decoding images, the most at once "
            "(server.max_image_requests); retry shortly",
            "messages",
        )
    try:
        yield
    finally:
        slots.release()


def _rendered(
    body: ChatCompletionRequest, tokenizer, prompter: ImagePrompter | None, config: ServerConfig
) -> tuple[list[int], ImageInputs | None]:
    """:func:`chat_prompt`'s work, its image slot held."""
    pictures = request_images(body, prompter, config)
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", "messages")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the assistant's", "messages")
    messages = [m.as_template_message() for m in body.messages]
    template_kwargs = dict(
        tools=body.tools,
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        **(body.chat_template_kwargs or {}),
    )
    try:
        if config.special_tokens_in_text == "text":
            ids = literal_template_ids(tokenizer, messages, **template_kwargs)
        else:
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **template_kwargs)
    except Exception as error:  # a template that rejects these messages is the caller's problem
        raise APIError(400, f"the chat template failed on these messages: {error}", "messages") from error
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if prompter is None:
        return list(ids), None
    try:
        return prompter.prompt(ids, pictures)
    except ValueError as error:  # the processor refused an image, or a placeholder does not match
        refuse_processed_images(body, prompter, pictures)
        raise APIError(400, f"the images do not fit the rendered prompt: {error}", "messages") from error


def refuse_processed_images(body: ChatCompletionRequest, prompter: ImagePrompter, pictures: list) -> None:
    """400 naming the first ``image_url`` part whose image the model's processor refuses on its own
    (Qwen2-VL's aspect ratio under 200): asked only once processing them together has failed."""
    for (where, _), picture in zip(image_parts(body), pictures, strict=True):
        try:
            process_images(prompter.processor, [picture])
        except ValueError as error:
            raise APIError(
                400,
                f"the model's image processor refuses this {picture.width}x{picture.height} image: {error}",
                where,
            ) from error


def image_parts(body: ChatCompletionRequest) -> list:
    """``(where, part)`` of every ``image_url`` part of the messages, in order."""
    return [
        (f"messages.{m}.content.{p}.image_url", part)
        for m, message in enumerate(body.messages)
        for p, part in message.image_parts()
    ]


def request_images(body: ChatCompletionRequest, prompter: ImagePrompter | None, config: ServerConfig) -> list:
    """The decoded images of the messages' ``image_url`` parts, in order; 400 naming the part when
    one is not a ``data:`` URL or not a usable image, when there are more than the server allows,
    or when the model takes no images."""
    parts = image_parts(body)
    if not parts:
        return []
    if prompter is None:
        raise APIError(400, "this model takes no images (it has no vision tower)", parts[0][0])
    if len(parts) > config.max_images_per_request:
        raise APIError(
            400,
            f"{len(parts)} images in one request; at most {config.max_images_per_request} "
            "(server.max_images_per_request)",
            parts[config.max_images_per_request][0],
        )
    images, pixels = [], 0
    for where, part in parts:
        # the header gives each image's size before it is decoded: the request's total never passes its limit
        left = config.max_request_image_pixels - pixels
        if left < config.max_image_pixels:
            limit = (
                f"the {left} pixels left of server.max_request_image_pixels={config.max_request_image_pixels}"
            )
            cap = left
        else:
            limit, cap = "server.max_image_pixels", config.max_image_pixels
        try:
            image = decode_data_url(part.image_url.url, cap, limit=limit)
        except ImageError as error:
            raise APIError(400, str(error), where) from error
        images.append(image)
        pixels += image.width * image.height
    return images


def sampling_params(
    body: SamplingFields,
    prompt_len: int,
    max_model_len: int,
    default_max_tokens: int | None,
    vocab_size: int,
    choice: int = 0,
) -> SamplingParams:
    """Engine sampling parameters for one choice; 400 when they cannot fit the context.

    ``default_max_tokens=None`` means "the rest of the context". With ``seed`` and ``n > 1``,
    choice ``i`` draws from a stream derived from ``(seed, i)`` so the choices differ. A
    temperature below :data:`GREEDY_BELOW_TEMPERATURE` is greedy (dividing logits by it would
    overflow to inf and NaN probabilities); a ``top_k`` of the vocabulary size or more is off.
    """
    requested = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        requested = body.max_completion_tokens
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; the model's context is {max_model_len} tokens",
            "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
        )
    max_tokens = requested or default_max_tokens or room
    if prompt_len + max_tokens > max_model_len:
        if requested is None:
            max_tokens = room
        else:
            raise APIError(
                400,
                f"max_tokens={max_tokens} plus the prompt's {prompt_len} tokens exceeds the model's "
                f"context of {max_model_len} tokens",
                "max_tokens",
            )
    stop_ids = tuple(body.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must lie in [0, {vocab_size})", "stop_token_ids")
    seed = body.seed
    if seed is not None and choice:
        seed = (seed * 1_000_003 + choice) % (2**62)
    try:
        return SamplingParams(
            temperature=0.0 if body.temperature < GREEDY_BELOW_TEMPERATURE else body.temperature,
            top_k=body.top_k if 0 < body.top_k < vocab_size else 0,
            top_p=body.top_p,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
            seed=seed,
            logprobs_mode=body.logprobs_mode,
        )
    except ValueError as error:
        raise APIError(400, str(error)) from error
