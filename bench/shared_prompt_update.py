"""Actor-update seconds for GRPO-shaped batches: shared-prompt packing vs plain packing.

A GRPO batch holds ``n`` responses per prompt. With ``share_prompts=True`` (the engine's
default) each prompt is packed once and its rows' responses attend to that one copy, the
other rows computing queries for their own responses only; with ``share_prompts=False``
every row carries its own copy of the prompt. Both engines train the same ~3M-parameter
Qwen2 (the GRPO benchmark's model) from the same weights on the same batches: 8 prompts x 8
responses, response lengths geometric (mean ~47 tokens) capped at ``--response-tokens``.
One step = forward + backward of a policy-gradient-shaped loss + optimizer step; the two
engines alternate step by step (the machine's speed drifts), and the medians of
``--repeats`` timed steps per prompt length are printed with their ratio.

    python bench/shared_prompt_update.py [--prompt-tokens 33 128 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.protocol import Batch

BENCH_MODEL = TinyModelConfig(
    family="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768
)
PROMPTS, RESPONSES, VOCAB = 8, 8, 103


def grpo_batch(seed: int, prompt_tokens: int, response_tokens: int) -> Batch:
    """``PROMPTS`` prompts of ``prompt_tokens`` tokens, each with ``RESPONSES`` responses of
    geometric length (p = 1/103, as a random model stopping on one of 103 tokens), capped."""
    gen = torch.Generator().manual_seed(seed)
    rows = PROMPTS * RESPONSES
    prompts = torch.randint(6, VOCAB, (PROMPTS, prompt_tokens), generator=gen).repeat_interleave(RESPONSES, 0)
    uniform = torch.rand(rows, generator=gen)
    lengths = (torch.log1p(-uniform) / torch.log1p(torch.tensor(-1 / VOCAB))).ceil().long()
    lengths = lengths.clamp(1, response_tokens)
    response_mask = (torch.arange(response_tokens) < lengths[:, None]).long()
    responses = torch.randint(6, VOCAB, (rows, response_tokens), generator=gen) * response_mask
    return Batch(
        {
            "prompts": prompts,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([torch.ones_like(prompts), response_mask], 1),
            "response_mask": response_mask,
            "advantages": torch.randn(rows, 1, generator=gen).expand(-1, response_tokens).contiguous(),
        }
    )


def policy_gradient_loss(micro: Batch, outputs):
    """``-mean(advantage * log p)`` over response tokens (the shape of a GRPO loss)."""
    width = micro["prompts"].shape[1]
    mask = micro["response_mask"].float()
    log_probs = outputs.log_probs[:, width:]
    return -(micro["advantages"] * log_probs * mask).sum() / mask.sum(), {}


def step_seconds(engine: TorchTrainEngine, batch: Batch) -> float:
    start = time.perf_counter()
    engine.forward_backward(batch, policy_gradient_loss)
    engine.optimizer_step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[33, 128, 256])
    parser.add_argument("--response-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_tiny_model(BENCH_MODEL, VOCAB, 0, 1, 4)
    engines = {}
    for share in (True, False):
        engine = TorchTrainEngine(EngineConfig(share_prompts=share, lr=1e-6), model=copy.deepcopy(model))
        engine.initialize()
        engines[share] = engine
    print(f"{PROMPTS} prompts x {RESPONSES} responses, responses <= {args.response_tokens} tokens, fp32")
    for prompt_tokens in args.prompt_tokens:
        batches = [grpo_batch(seed, prompt_tokens, args.response_tokens) for seed in range(args.repeats + 1)]
        times: dict[bool, list[float]] = {True: [], False: []}
        for index, batch in enumerate(batches):
            for share in (True, False) if index % 2 else (False, True):
                seconds = step_seconds(engines[share], batch)
                if index:  # the first batch warms both engines up
                    times[share].append(seconds)
        shared, plain = statistics.median(times[True]), statistics.median(times[False])
        print(
            f"prompt {prompt_tokens:4d} tokens: plain packing {plain:.3f} s, shared prompts {shared:.3f} s "
            f"-> {plain / shared:.2f}x"
        )


if __name__ == "__main__":
    main()
