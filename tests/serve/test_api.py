"""The OpenAI-compatible endpoints, through the real ``openai`` client, against direct engine calls."""

import asyncio
import threading

import pytest

from tandem.rollout import RolloutRequest, SamplingParams
from tests.serve.conftest import http

openai = pytest.importorskip("openai")


def direct(engine, prompt_ids, **params):
    """The reference: the same request straight to the engine."""
    request = RolloutRequest(
        f"ref-{threading.get_ident()}-{id(prompt_ids)}", tuple(prompt_ids), SamplingParams(**params)
    )
    return engine.generate_batch([request], timeout=60)[0]


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].max_model_len == 128
    assert http(server.url + "/health") == (200, {"status": "ok", "version": 0})
    client.completions.create(model="tiny", prompt="warm", max_tokens=4, temperature=0)
    status, text = http(server.url + "/metrics")
    assert status == 200
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert samples['tandem_weight_version{model="tiny"}'] == "0"
    assert float(samples['tandem_generation_tokens_per_second{model="tiny"}']) > 0
    assert int(samples['tandem_generation_tokens_total{model="tiny"}']) >= 4
    assert samples['tandem_requests_running{model="tiny"}'] == "0"
    assert int(samples['tandem_http_requests_total{route="/v1/completions",status="200"}']) >= 1


def test_completion_equals_the_engine(client, engine, tokenizer):
    response = client.completions.create(
        model="tiny",
        prompt="The answer is",
        max_tokens=12,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = tokenizer.encode("The answer is", add_special_tokens=False)
    reference = direct(engine, prompt_ids, temperature=0.0, max_tokens=12, ignore_eos=True)
    choice = response.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == reference.token_ids and choice.weight_versions == [0] * 12
    assert choice.logprobs.token_logprobs == pytest.approx(reference.log_probs, abs=1e-6)
    assert choice.text == tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == 12
    # the prompt as token ids gives the same response: agent loops can stay in token space
    by_ids = client.completions.create(
        model="tiny", prompt=prompt_ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].token_ids == reference.token_ids


def test_chat_uses_the_template_and_matches_the_engine(client, engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0.8, seed=11, logprobs=True
    )
    prompt_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert response.prompt_token_ids == list(prompt_ids)
    reference = direct(engine, prompt_ids, temperature=0.8, max_tokens=10, seed=11)
    choice = response.choices[0]
    assert choice.token_ids == reference.token_ids
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(reference.log_probs, abs=1e-6)
    assert choice.message.role == "assistant"
    assert choice.message.content == tokenizer.decode(reference.token_ids, skip_special_tokens=True)


def test_streaming_equals_non_streaming(client):
    common = dict(model="tiny", max_tokens=16, temperature=1.0, seed=5, n=2, logprobs=True)
    messages = [{"role": "user", "content": "tell me"}]
    whole = client.chat.completions.create(messages=messages, **common)
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **common
    )
    text, tokens, logprobs, finish, usage = ["", ""], [[], []], [[], []], [None, None], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            tokens[c.index] += c.token_ids
            logprobs[c.index] += [e.logprob for e in (c.logprobs.content if c.logprobs else [])]
            finish[c.index] = c.finish_reason or finish[c.index]
    assert whole.choices[0].token_ids != whole.choices[1].token_ids  # n choices are different samples
    for i in range(2):
        assert tokens[i] == whole.choices[i].token_ids
        assert text[i] == whole.choices[i].message.content
        assert logprobs[i] == pytest.approx([e.logprob for e in whole.choices[i].logprobs.content])
        assert finish[i] == whole.choices[i].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_completion_streaming_and_batched_prompts(client):
    prompts = ["abc", "hello there"]
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0, logprobs=1)
    assert [c.index for c in whole.choices] == [0, 1]
    text = ["", ""]
    for chunk in client.completions.create(
        model="tiny", prompt=prompts, max_tokens=8, temperature=0, stream=True
    ):
        for c in chunk.choices:
            text[c.index] += c.text
    assert text == [c.text for c in whole.choices]
    offsets = whole.choices[1].logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_stop_string_cuts_the_text_streamed_or_not(client):
    base = client.completions.create(
        model="tiny", prompt="xyz", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    full = base.choices[0].text
    stop = full[10:12]  # a piece from the middle of the greedy answer
    cut = full.find(stop)
    stopped = client.completions.create(model="tiny", prompt="xyz", max_tokens=30, temperature=0, stop=[stop])
    assert stopped.choices[0].text == full[:cut] and stopped.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="xyz", max_tokens=30, temperature=0, stop=stop, stream=True
        )
        if c.choices
    )
    assert streamed == full[:cut]


def test_concurrent_requests_equal_sequential_ones(client):
    prompts = [f"question {i}: " + "ab" * i for i in range(12)]
    sequential = [
        client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].token_ids
        for p in prompts
    ]
    results = [None] * len(prompts)

    def ask(i):
        results[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=10, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [r.choices[0].token_ids for r in results] == sequential


def test_async_client_many_concurrent_streams(server):
    asyncio.run(many_streams(server.url))


async def many_streams(url):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    async def one(i):
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"hi {i}"}],
            max_tokens=6,
            temperature=0,
            stream=True,
        )
        return [t async for chunk in stream for c in chunk.choices for t in c.token_ids]

    streamed = await asyncio.gather(*(one(i) for i in range(20)))
    for i, tokens in enumerate(streamed):
        whole = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=6, temperature=0
        )
        assert tokens == whole.choices[0].token_ids
