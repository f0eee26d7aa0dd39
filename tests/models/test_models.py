"""Tiny models and tokenizers load through the real from_pretrained path; fp32 chunked log-probs match the reference."""

import pytest
import torch

from tandem.models import (
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_model,
    check_vocab_compatible,
    load_model,
    load_tokenizer,
    log_probs_from_hidden,
    log_probs_from_logits,
    save_tiny_model,
)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"])
def test_save_and_load_round_trip(tmp_path, family):
    path = save_tiny_model(tmp_path / family, TinyModelConfig(family=family))
    model, tokenizer = load_model(path), load_tokenizer(path)
    check_vocab_compatible(model, tokenizer)
    assert model.config.model_type == family
    reference = build_char_tokenizer()
    text = "Q: 17+25=?\nA: 42"
    assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    fresh = build_tiny_model(TinyModelConfig(family=family), len(reference), 0, 1, reference.eos_token_id)
    for (name, a), (_, b) in zip(fresh.state_dict().items(), model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name  # same seed -> same weights, saved and loaded exactly


@pytest.mark.parametrize("text", ["a\n\nb", "\n\n\n", "tab\t\tthen  spaces\n\t\n"])
def test_every_character_is_one_token_in_runs_of_whitespace(text):
    tokenizer = build_char_tokenizer()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == [tokenizer.convert_tokens_to_ids(character) for character in text]
    assert tokenizer.decode(ids) == text


def test_chat_template_and_special_tokens():
    tokenizer = build_char_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id == 0


def test_vocab_mismatch_is_a_clear_error(tmp_path):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(), vocab_size=50, pad_token_id=0, bos_token_id=1, eos_token_id=4)
    with pytest.raises(
        ValueError, match="vocab mismatch: the tokenizer has 103 ids but the model's embedding has 50 rows"
    ):
        check_vocab_compatible(model, tokenizer)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load_model(tmp_path)


def test_tiny_config_validation_names_the_field():
    with pytest.raises(ValueError, match="tiny_model.family='gpt2'"):
        TinyModelConfig(family="gpt2")
    with pytest.raises(ValueError, match="hidden_size=100 must divide by num_heads=3"):
        TinyModelConfig(hidden_size=100, num_heads=3, num_kv_heads=1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_fp32_log_probs_match_full_logits(chunk, temperature):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=gen).bfloat16().requires_grad_(True)
    weight = torch.randn(300, 16, generator=gen).requires_grad_(True)
    labels = torch.randint(0, 300, (50,), generator=gen)
    log_probs, entropy, sum_pi_squared = log_probs_from_hidden(
        hidden, weight, labels, temperature, chunk, with_sum_pi_squared=True
    )[:3]
    logits = hidden.float() @ weight.t() / temperature
    expected = log_probs_from_logits(logits, labels)
    probs = torch.softmax(logits, -1)
    expected_entropy = -(probs * torch.log_softmax(logits, -1)).sum(-1)
    assert log_probs.dtype == torch.float32
    torch.testing.assert_close(log_probs, expected)
    torch.testing.assert_close(entropy, expected_entropy)
    torch.testing.assert_close(sum_pi_squared, probs.square().sum(-1))
    assert not sum_pi_squared.requires_grad
    assert log_probs_from_hidden(hidden, weight, labels, temperature, chunk).sum_pi_squared is None
    grads = torch.autograd.grad(log_probs.sum() + entropy.sum(), (hidden, weight))
    expected_grads = torch.autograd.grad(expected.sum() + expected_entropy.sum(), (hidden, weight))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 sums in a different order


def test_the_fp32_heads_gradient_for_bf16_weights_adds_the_chunks_up_in_fp32():
    """FSDP2's bf16 parameters: the fp32 head casts the weight once, so its gradient is the fp32
    head's over the whole batch rounded once to bf16, not a bf16 sum of per-chunk gradients."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(400, 16, generator=gen).bfloat16()
    weight = (torch.randn(300, 16, generator=gen) * 0.3).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 300, (400,), generator=gen)
    log_probs = log_probs_from_hidden(hidden, weight, labels, chunk_size=7).log_probs
    (grad,) = torch.autograd.grad(log_probs.sum(), weight)
    reference = weight.detach().float().requires_grad_(True)
    expected = log_probs_from_logits(hidden.float() @ reference.t(), labels)
    (want,) = torch.autograd.grad(expected.sum(), reference)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), want.bfloat16().float(), atol=1e-6, rtol=0)
