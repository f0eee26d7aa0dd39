"""``tandem serve SmolLM2.gguf`` answers what the native engine generates for the same greedy request."""

import os

import pytest

from tests.serve.conftest import free_port, serve_process  # skips without the serve extra

openai = pytest.importorskip("openai")

QUESTION = "What is the capital of France? One word."


def test_tandem_serve_on_the_gguf_file_answers_as_the_engine(smollm2_gguf, smollm2_dir, smollm2_tokenizer):
    from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
    from tests.real_model.conftest import chat_prompt

    port = free_port()
    env = {**os.environ, "TANDEM_API_KEY": "k"}
    with serve_process(str(smollm2_gguf), port, "--max-model-len", "256", env=env):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=300)
        response = client.chat.completions.create(
            model=smollm2_gguf.name, messages=[{"role": "user", "content": QUESTION}], max_tokens=12, temperature=0
        )
    prompt = chat_prompt(smollm2_tokenizer, QUESTION)
    engine = NativeRolloutEngine.from_pretrained(smollm2_dir, NativeEngineConfig(max_num_seqs=2, max_model_len=256))
    try:
        (reference,) = engine.generate_batch(
            [RolloutRequest("ref", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=12))]
        )
    finally:
        engine.close()
    choice = response.choices[0]
    assert response.prompt_token_ids == prompt
    assert choice.token_ids == reference.token_ids
    assert choice.message.content == smollm2_tokenizer.decode(reference.token_ids, skip_special_tokens=True)
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[reference.finish_reason]
