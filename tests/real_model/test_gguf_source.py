"""The real GGUF file as a model source: its conversion equals transformers' own GGUF load, is
reused, and a truncated copy is refused in one line."""

import logging
from pathlib import Path

import pytest
import torch

from tandem.models.gguf import SOURCE_FILE, GGUFError, resolve_model_path
from tandem.models.loading import load_model, load_tokenizer


def test_a_truncated_copy_is_refused_in_one_line_naming_it(smollm2_gguf, tmp_path):
    broken = tmp_path / "SmolLM2-interrupted-download.gguf"
    with open(smollm2_gguf, "rb") as source, open(broken, "wb") as target:
        target.write(source.read(smollm2_gguf.stat().st_size // 2))  # half the tensors' bytes
    with pytest.raises(GGUFError, match=r"SmolLM2-interrupted-download\.gguf: truncated or corrupt GGUF") as caught:
        resolve_model_path(str(broken), tmp_path / "cache")
    assert "\n" not in str(caught.value)
    assert not any((tmp_path / "cache").glob("*/config.json"))  # nothing half-written left behind


def test_a_second_resolve_reuses_the_conversion(smollm2_gguf, smollm2_dir, caplog):
    before = {path.name: path.stat().st_mtime_ns for path in Path(smollm2_dir).iterdir()}
    with caplog.at_level(logging.INFO, logger="tandem.models.gguf"):
        again = resolve_model_path(str(smollm2_gguf))
        by_directory = resolve_model_path(str(smollm2_gguf.parent))  # the package folder holds just this file
    assert again == by_directory == smollm2_dir
    assert not [record for record in caplog.records if "convert" in record.getMessage()]  # no second conversion
    assert {path.name: path.stat().st_mtime_ns for path in Path(smollm2_dir).iterdir()} == before
    assert SOURCE_FILE in before  # written last: its presence marks a whole conversion


@pytest.mark.slow  # a second de-quantization of the whole file (~30 s of CPU); the tokenizer's sibling is fast
def test_the_converted_weights_equal_transformers_direct_gguf_load(smollm2_gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM, GgufConfig

    direct = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
        quantization_config=GgufConfig(dequantize=True), dtype=torch.float32,
    )  # fmt: skip
    converted = load_model(smollm2_dir)
    expected, got = direct.state_dict(), converted.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in expected)
    assert converted.config.tie_word_embeddings and converted.dtype == torch.float32


def test_the_converted_tokenizer_equals_transformers_direct_gguf_load(smollm2_gguf, smollm2_dir):
    from transformers import AutoTokenizer

    direct = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    tokenizer = load_tokenizer(smollm2_dir)
    text = "<|im_start|>user\nWhat is 12+7? Reply in Français, s'il vous plaît.<|im_end|>\n"
    assert tokenizer(text).input_ids == direct(text).input_ids
    assert tokenizer.chat_template == direct.chat_template and tokenizer.eos_token == direct.eos_token == "<|im_end|>"
    assert len(tokenizer) == len(direct) == 49152


def test_a_trainer_config_resolves_to_the_one_cached_directory(smollm2_gguf, smollm2_dir):
    from tandem.models.gguf import with_gguf_resolved
    from tandem.sft import SFTConfig, SFTDataConfig

    config = SFTConfig(model_path=str(smollm2_gguf), data=SFTDataConfig(train_path="unused.jsonl"))
    resolved = with_gguf_resolved(config)
    assert resolved.model_path == smollm2_dir and resolved.engine.model_path == ""  # the rest untouched
