"""The generation layout (left-padded prompts, right-padded responses) against a per-row reference."""

import random

import torch

from tandem.protocol import Batch
from tandem.protocol.generation import Completion
from tandem.protocol.sequences import concat_sequences, sequence_tensors, trim_padding
from tandem.rl.stages.dynamic_sampling import groups_with_spread

PAD = 0


def _random_rows(rng: random.Random, count: int):
    prompts, completions = [], []
    for i in range(count):
        prompt = [rng.randint(1, 50) for _ in range(rng.randint(1, 7))]
        response = [rng.randint(1, 50) for _ in range(rng.randint(0, 5))]
        prompts.append(prompt)
        completions.append(
            Completion(
                request_id=str(i),
                prompt_ids=tuple(prompt),
                token_ids=response,
                log_probs=[-rng.random() for _ in response],
                weight_versions=[3] * len(response),
                finish_reason="stop",
            )
        )
    return prompts, completions


def _row_reference(tensors, row):
    """Recover (prompt, response, log-probs) of one row by walking its masks."""
    width = tensors["prompts"].shape[1]
    mask = tensors["attention_mask"][row].tolist()
    ids = tensors["input_ids"][row].tolist()
    prompt = [t for t, m in zip(ids[:width], mask[:width], strict=True) if m]
    response = [t for t, m in zip(ids[width:], mask[width:], strict=True) if m]
    n = int(tensors["response_mask"][row].sum())
    return prompt, response, tensors["rollout_log_probs"][row, :n].tolist()


def test_sequence_tensors_lay_out_every_row_like_the_reference():
    prompts, completions = _random_rows(random.Random(0), 20)
    tensors = sequence_tensors(prompts, completions, PAD)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        got_prompt, got_response, got_log_probs = _row_reference(tensors, row)
        assert got_prompt == prompt and got_response == completion.token_ids
        assert got_log_probs == torch.tensor(completion.log_probs, dtype=torch.float32).tolist()
        positions = tensors["position_ids"][row][tensors["attention_mask"][row].bool()].tolist()
        assert positions == list(range(len(prompt) + len(completion.token_ids)))
    assert (tensors["weight_version"][tensors["response_mask"].bool()] == 3).all()


def test_trim_and_concat_keep_every_row():
    rng = random.Random(1)
    first = Batch(sequence_tensors(*_random_rows(rng, 6), PAD))
    second = Batch(sequence_tensors(*_random_rows(rng, 9), PAD))
    wide = concat_sequences([first, second], PAD)
    assert wide["prompts"].shape[1] == max(first["prompts"].shape[1], second["prompts"].shape[1])
    trimmed = trim_padding(wide, PAD)
    expected = [_row_reference(first.tensors, r) for r in range(6)] + [
        _row_reference(second.tensors, r) for r in range(9)
    ]
    for batch in (wide, trimmed):
        assert [_row_reference(batch.tensors, r) for r in range(15)] == expected
    longest_prompt = max(len(p) for p, _, _ in expected)
    longest_response = max(1, max(len(r) for _, r, _ in expected))
    assert trimmed["prompts"].shape[1] == longest_prompt and trimmed["responses"].shape[1] == longest_response


def test_groups_with_spread_matches_a_loop_on_score_or_accuracy():
    scores = torch.tensor([1, 1, 1, 0, 0, 0, 0, 0, 0.5, 1, 0.5, 0.5], dtype=torch.float32)
    accuracy = torch.tensor([1, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 1], dtype=torch.float32)
    batch = Batch({"token_level_scores": torch.stack([torch.zeros(12), scores], dim=1), "acc": accuracy})
    for metric, values in (("score", scores), ("acc", accuracy)):
        expected = [len(set(values[g * 3 : g * 3 + 3].tolist())) > 1 for g in range(4)]
        assert groups_with_spread(batch, 3, metric).tolist() == expected
