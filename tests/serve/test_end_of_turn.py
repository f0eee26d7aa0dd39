"""``tandem serve`` ends an answer at an end-of-turn id named only in ``generation_config.json``,
with ``finish_reason`` ``stop`` and the id stripped from the text, as HF ``generate`` ends it (issue 54)."""

import openai
import pytest
import torch

from tandem.models import load_model, load_tokenizer
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine
from tandem.serve import ServerConfig, ServerThread
from tests.models.end_of_turn import END_OF_TURN, PROMPT_TEXT, save_end_of_turn_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_end_of_turn_model(tmp_path_factory.mktemp("end_of_turn") / "model"))


def test_the_answer_stops_at_the_end_of_turn_id_like_hf_generate(model_dir):
    tokenizer = load_tokenizer(model_dir)
    prompt = tokenizer.encode(PROMPT_TEXT, add_special_tokens=False)
    output = load_model(model_dir).generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    reference = output[0, len(prompt) :].tolist()  # ends with <|im_end|> (tests/rollout/test_end_of_turn.py)
    engine = NativeRolloutEngine.from_pretrained(
        model_dir, NativeEngineConfig(max_num_seqs=4, max_model_len=64)
    )
    try:
        with ServerThread(engine, tokenizer, ServerConfig(port=0, model_name="tiny")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            answer = client.completions.create(model="tiny", prompt=PROMPT_TEXT, max_tokens=24, temperature=0)
            streamed = client.completions.create(
                model="tiny", prompt=PROMPT_TEXT, max_tokens=24, temperature=0, stream=True
            )
            chunks = list(streamed)
    finally:
        engine.close()
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert answer.usage.completion_tokens == len(reference)
    assert choice.text == tokenizer.decode(reference[:-1]) and END_OF_TURN not in choice.text
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"
