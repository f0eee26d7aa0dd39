"""An end-of-turn id named only in ``generation_config.json`` ends a response in every engine,
exactly where HF ``generate`` ends it on the same directory (issue 54)."""

import pytest
import torch

from tandem.models import load_model, load_tokenizer
from tandem.protocol.generation import Completion, RolloutRequest, SamplingParams
from tandem.protocol.sequences import decode_responses, sequence_tensors
from tandem.rollout import HFRolloutEngine, NativeEngineConfig, NativeRolloutEngine
from tests.models.end_of_turn import (
    END_OF_TEXT,
    END_OF_TURN,
    PROMPT_TEXT,
    TOKENS_BEFORE_END,
    save_end_of_turn_model,
)

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_end_of_turn_model(tmp_path_factory.mktemp("end_of_turn") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tuple(tokenizer.encode(PROMPT_TEXT, add_special_tokens=False))


@pytest.fixture(scope="module")
def reference(model_dir, prompt):
    """HF ``generate``'s greedy response on the directory, with its own defaults (generation_config.json)."""
    model = load_model(model_dir)
    output = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return output[0, len(prompt) :].tolist()


def greedy(prompt, **extra):
    return RolloutRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **extra))


def test_hf_generate_stops_at_the_end_of_turn_id(reference, tokenizer):
    """The layout itself: HF ends the response at <|im_end|>, which config.json does not name."""
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert tokenizer.eos_token == END_OF_TEXT
    assert len(reference) == TOKENS_BEFORE_END + 1 and reference[-1] == end_of_turn


@pytest.mark.parametrize("engine_name", ["native", "hf"])
def test_engines_stop_where_hf_generate_does(engine_name, model_dir, prompt, reference):
    if engine_name == "native":
        engine = NativeRolloutEngine.from_pretrained(
            str(model_dir), NativeEngineConfig(max_num_seqs=4, max_model_len=64)
        )
    else:
        engine = HFRolloutEngine.from_pretrained(str(model_dir))
    try:
        completion = engine.generate_batch([greedy(prompt)], timeout=60)[0]
        through = engine.generate_batch([greedy(prompt, ignore_eos=True)], timeout=60)[0]
    finally:
        engine.close()
    assert completion.token_ids == reference
    assert completion.finish_reason == "stop"
    assert len(through.token_ids) == MAX_TOKENS and through.token_ids[: len(reference)] == reference


def test_the_mask_and_the_rewarded_text_treat_the_end_of_turn_id_as_eos(tokenizer, prompt, reference):
    """A response ended by <|im_end|> gets the mask and text one ended by config.json's EOS gets."""
    end_of_text = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    by_turn = Completion(
        "turn",
        prompt,
        token_ids=reference,
        log_probs=[0.0] * len(reference),
        weight_versions=[0] * len(reference),
    )
    by_text = Completion(
        "text",
        prompt,
        token_ids=[*reference[:-1], end_of_text],
        log_probs=[0.0] * len(reference),
        weight_versions=[0] * len(reference),
    )
    tensors = sequence_tensors([prompt, prompt], [by_turn, by_text], tokenizer.pad_token_id)
    assert torch.equal(tensors["response_mask"][0], tensors["response_mask"][1])
    texts = decode_responses(tokenizer, tensors["responses"], tensors["response_mask"].sum(-1))
    assert texts[0] == texts[1] == tokenizer.decode(reference[:-1])
    assert END_OF_TURN not in texts[0]
