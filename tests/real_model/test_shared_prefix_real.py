"""On SmolLM2 (9 query heads over 3 key/value heads): the native engine's shared-prefix cascade
attention gives the tokens and log-probs of its plain decode attention (the tiny-model sibling
is tests/rollout/test_shared_prefix.py)."""

import pytest

from tests.real_model.conftest import chat_prompt

pytestmark = pytest.mark.slow


def test_cascade_and_plain_attention_give_the_same_tokens_and_log_probs(smollm2_dir, smollm2_tokenizer):
    from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams

    prompts = [
        chat_prompt(
            smollm2_tokenizer,
            f"What is {a} + {b}? Think step by step, explain each step carefully, then give the answer.",
        )
        for a, b in ((17, 25), (305, 46))
    ]
    requests = [
        RolloutRequest(
            f"r{i}", tuple(prompts[i // 16]), SamplingParams(temperature=1.0, max_tokens=8, seed=i)
        )
        for i in range(32)  # 2 prompts x 16 samples: the rule shares them
    ]
    results = {}
    for share in (True, False):
        engine = NativeRolloutEngine.from_pretrained(
            smollm2_dir, NativeEngineConfig(max_num_seqs=32, max_model_len=128, share_prefix_reads=share)
        )
        try:
            results[share] = engine.generate_batch(requests, timeout=600)
            assert (engine.stats.shared_prefix_steps > 0) == share
        finally:
            engine.close()
    worst = 0.0
    for ours, plain in zip(results[True], results[False], strict=True):
        assert ours.token_ids == plain.token_ids
        worst = max([worst, *(abs(a - b) for a, b in zip(ours.log_probs, plain.log_probs, strict=True))])
    # fp32 through 30 layers: only the summation order of the attention's weighted sum differs
    # (2.3e-5 measured); the tier's bound for native vs HF log-probs is 1e-4
    assert worst < 1e-4, worst
