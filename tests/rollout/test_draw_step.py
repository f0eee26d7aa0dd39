"""``draw_step`` (one transfer per step, truncation skipped when no row asks) against the
sampler's building blocks called row by row."""

from __future__ import annotations

import pytest
import torch

from tandem.rollout import SamplingParams
from tandem.rollout.sampling import counter_uniforms, draw_step, processed_logits, sample_tokens


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.5, logprobs_mode="raw"),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, logprobs_mode="raw"),
    ]


def one_row(logits: torch.Tensor, params: SamplingParams, seed: int, step: int) -> tuple[int, float]:
    """The row alone, through the public pieces, with its own settings only."""
    processed = processed_logits(
        logits, torch.tensor([params.temperature]), torch.tensor([params.top_k]), torch.tensor([params.top_p])
    )
    uniforms = counter_uniforms(torch.tensor([seed]), torch.tensor([step]))
    token = int(sample_tokens(processed, torch.tensor([params.temperature == 0]), uniforms)[0])
    scored = logits if params.logprobs_mode == "raw" else processed
    return token, float(torch.log_softmax(scored, -1)[0, token])


@pytest.mark.parametrize("rows", [6, 48])  # 48: over the small-batch threshold of the key path
def test_draw_step_equals_each_row_drawn_alone(rows):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, 97, generator=gen) * 3
    params = [mixed_params()[i % 6] for i in range(rows)]
    seeds, steps = [100 + 7 * i for i in range(rows)], [i % 5 for i in range(rows)]
    draws = draw_step(logits, params, seeds, steps)
    for i in range(rows):
        token, log_prob = one_row(logits[i : i + 1], params[i], seeds[i], steps[i])
        assert draws.tokens[i] == token, i
        assert draws.log_probs[i] == pytest.approx(log_prob, abs=1e-6), i


@pytest.mark.parametrize(
    "temperatures",
    [(1.0, 1.0, 1.0, 1.0), (0.0, 1.0, 0.0, 1.0), (0.0, 0.0, 0.0, 0.0)],
    ids=["all-one", "ones-and-greedy", "all-greedy"],
)
def test_a_step_that_skips_the_division_and_the_argmax_draws_as_each_row_alone(temperatures):
    """Temperatures of 1 and 0 only: the step divides nothing and, without greedy rows, takes
    no argmax; the rows alone (divided by their temperature, argmax taken) draw the same."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(len(temperatures), 1031, generator=gen) * 4
    params = [SamplingParams(temperature=t, top_p=0.95 if i == 1 else 1.0) for i, t in enumerate(temperatures)]
    seeds, steps = [11, 12, 13, 14], [0, 1, 2, 3]
    draws = draw_step(logits, params, seeds, steps)
    for i in range(len(params)):
        token, log_prob = one_row(logits[i : i + 1], params[i], seeds[i], steps[i])
        assert draws.tokens[i] == token, i
        assert draws.log_probs[i] == pytest.approx(log_prob, abs=1e-6), i


def test_a_row_without_top_p_keeps_its_whole_tail_beside_rows_that_truncate():
    """Rows at top_p=1 keep every token even when another row truncates (rounding of the
    cumulative mass near 1 removes nothing)."""
    logits = torch.linspace(0, 30, 1000).repeat(2, 1)  # a long, tiny-probability tail
    alone = processed_logits(logits[:1], torch.ones(1), None, None)
    mixed = processed_logits(logits, torch.ones(2), None, torch.tensor([1.0, 0.5]))
    assert torch.isfinite(mixed[0]).all() and torch.equal(mixed[0], alone[0])
    assert torch.isinf(mixed[1]).any()


def test_non_finite_rows_are_named_by_draw_step():
    logits = torch.linspace(-5.0, 5.0, 103).repeat(3, 1)
    params = [SamplingParams(temperature=1e-40), SamplingParams(), SamplingParams(temperature=1e-40)]
    with pytest.raises(ValueError, match=r"not finite .* rows \[0, 2\]"):
        draw_step(logits, params, [1, 2, 3], [0, 0, 0])
