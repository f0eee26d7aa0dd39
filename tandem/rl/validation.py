"""The RL run's validation: its prompts and seeds, its per-source accuracy metrics, and the samples
the report shows (:meth:`tandem.rl.trainer.RLTrainer.validate` generates and scores between them)."""

from __future__ import annotations

from typing import Any

import torch

from tandem.data.images import decode_image
from tandem.protocol import Batch
from tandem.protocol.sequences import response_lengths
from tandem.report.samples import thumbnail_url
from tandem.rl.data import RLDataset
from tandem.seeds import derive_seed

VALIDATION_SEED_TAG = 7_777_777  # derive_seed(run seed, this, row): validation sampling
VAL_SAMPLES_LOGGED = 4  # validation prompts whose first response (and pictures) val_samples.jsonl keeps


def validation_prompts(
    val_data: RLDataset, max_samples: int, val_n: int, run_seed: int
) -> tuple[Batch, list[int]]:
    """The first ``max_samples`` validation prompts (all when 0), each repeated ``val_n`` times
    in a row, and one sampling seed per row, derived from the run's seed."""
    count = len(val_data)
    if max_samples:
        count = min(count, max_samples)
    prompts = val_data.collate(list(range(count))).repeat(val_n, interleave=True)
    seeds = [derive_seed(run_seed, VALIDATION_SEED_TAG, i) for i in range(len(prompts))]
    return prompts, seeds


def validation_metrics(scored: Batch, val_n: int) -> dict[str, float]:
    """Accuracy and score per data source of the scored validation responses
    (``val-core/<source>/acc/mean@<n>``, ``val-aux/<source>/score/mean@<n>``) and their mean length."""
    metrics: dict[str, float] = {}
    sources = scored["data_source"]
    for source in sorted(set(sources)):
        rows = torch.tensor([s == source for s in sources])
        metrics[f"val-core/{source}/acc/mean@{val_n}"] = float(scored["acc"][rows].mean())
        metrics[f"val-aux/{source}/score/mean@{val_n}"] = float(
            scored["token_level_scores"][rows].sum(-1).mean()
        )
    metrics["val-aux/response_length/mean"] = float(response_lengths(scored).float().mean())
    return metrics


def validation_samples(
    scored: Batch, val_data: RLDataset, tokenizer: Any, val_n: int
) -> list[dict[str, Any]]:
    """The first :data:`VAL_SAMPLES_LOGGED` validation prompts' first responses, with their
    pictures as thumbnails and an agent program's log (``agent_program_log``: its fault, a
    command's output): the rows of the run's ``val_samples.jsonl`` (the report shows them)."""
    samples = []
    for prompt in range(min(VAL_SAMPLES_LOGGED, len(scored) // val_n)):
        row = prompt * val_n
        mask = scored["response_mask"][row].bool()
        pictures = val_data.samples[prompt].images
        samples.append(
            {
                "prompt": tokenizer.decode(scored["prompt_ids"][row], skip_special_tokens=True),
                "response": tokenizer.decode(scored["responses"][row][mask], skip_special_tokens=True),
                "score": float(scored["token_level_scores"][row].sum()),
                "ground_truth": str(scored["ground_truth"][row]),
                "images": [thumbnail_url(decode_image(raw)) for raw in pictures.encoded] if pictures else [],
                **({"program_log": scored["agent_program_log"][row]} if "agent_program_log" in scored else {}),
            }
        )
    return samples
