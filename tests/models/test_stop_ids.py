"""``end_of_sequence_ids``: the union of config.json's, generation_config.json's and the
tokenizer's end-of-sequence ids, from a directory or a loaded model (issue 54)."""

from tandem.models import TinyModelConfig, load_model, load_tokenizer, save_tiny_model
from tandem.models.stop_ids import end_of_sequence_ids
from tandem.models.tiny_vlm import TinyVLMConfig, build_tiny_vlm
from tandem.models.tokenizer import build_char_tokenizer
from tests.models.end_of_turn import END_OF_TEXT, END_OF_TURN, save_end_of_turn_model


def test_an_id_named_only_in_generation_config_is_an_end_of_sequence_id(tmp_path):
    path = save_end_of_turn_model(tmp_path / "model")
    tokenizer = load_tokenizer(path)
    expected = frozenset(tokenizer.convert_tokens_to_ids([END_OF_TEXT, END_OF_TURN]))
    assert end_of_sequence_ids(path, tokenizer) == expected
    assert end_of_sequence_ids(str(path), tokenizer) == expected
    assert end_of_sequence_ids(load_model(path), tokenizer) == expected


def test_without_a_generation_config_the_config_and_tokenizer_ids_count(tmp_path):
    path = save_tiny_model(tmp_path / "model", TinyModelConfig())
    (path / "generation_config.json").unlink()
    tokenizer = load_tokenizer(path)
    assert end_of_sequence_ids(path, tokenizer) == {tokenizer.eos_token_id}
    tokenizer.eos_token = END_OF_TEXT  # a tokenizer whose EOS the config does not name adds it
    assert end_of_sequence_ids(path, tokenizer) == {
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids(END_OF_TURN),
    }


def test_a_vision_language_model_counts_its_text_config(tmp_path):
    tokenizer = build_char_tokenizer(vision=True)
    model = build_tiny_vlm(TinyVLMConfig(), tokenizer)
    model.config.get_text_config().eos_token_id = [tokenizer.eos_token_id, 2]
    model.generation_config.eos_token_id = None
    assert end_of_sequence_ids(model, tokenizer) == {tokenizer.eos_token_id, 2}
