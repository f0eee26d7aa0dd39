"""The RL run's validation: its prompts and seeds, how they are generated and scored, its per-source
accuracy metrics, and the samples the report shows (:meth:`tandem.rl.trainer.RLTrainer.validate`).

Where the run's draws stay in the data plane (:func:`tandem.rl.step_data.rollout_stays_in_store`),
so do the validation responses (:func:`scored_validation`): the request names each prompt's place
in the validation file (the ranks or replicas read its ids and images), the responses are put into
the generating ranks' or replicas' blocks, scored on the texts decoded there, and only the per-row
scalars (source, score, accuracy, length, text) reach the controller, which then releases the
blocks. Agent episodes are scored on their conversations, which come back with the scalars as in
training; the few responses ``val_samples.jsonl`` logs are decoded by a trainer rank that reads
their tokens (``response_texts``). A source without ``generate_to_store`` and the off path go the
``Batch`` way: the prompts collated here, the generated sequences returned here and scored. Both
give the same metrics and samples (``tests/rl/test_dataplane_validation.py``; agent episodes:
``tests/pipeline/test_agent_validation_stored.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.data.images import decode_image
from tandem.dataplane import BatchRef
from tandem.pipeline.stored_rollout import RESPONSE_TEXT
from tandem.protocol import Batch
from tandem.protocol.sequences import decode_sampled, response_lengths
from tandem.report.samples import thumbnail_url
from tandem.rl.data import RLDataset
from tandem.rl.row_fields import SEQUENCE_SCORE
from tandem.rl.step_data import rollout_stays_in_store
from tandem.seeds import derive_seed

VALIDATION_SEED_TAG = 7_777_777  # derive_seed(run seed, this, row): validation sampling
VAL_SAMPLES_LOGGED = 4  # validation prompts whose first response (and pictures) val_samples.jsonl keeps


def validation_count(val_data: RLDataset, max_samples: int) -> int:
    """How many validation prompts a validation answers: the first ``max_samples`` (all when 0)."""
    return min(len(val_data), max_samples) if max_samples else len(val_data)


def validation_seeds(count: int, val_n: int, run_seed: int) -> list[int]:
    """One sampling seed per validation row (``count`` prompts, each ``val_n`` times in a row),
    derived from the run's seed."""
    return [derive_seed(run_seed, VALIDATION_SEED_TAG, i) for i in range(count * val_n)]


def stores_validation(trainer: Any) -> bool:
    """Whether ``trainer``'s validation responses stay in the data plane: its draws do and its
    batch source keeps generations (``generate_to_store``: agent episodes too)."""
    keeps = getattr(trainer.rollout, "generate_to_store", None) is not None
    has_images = any(sample.images for sample in trainer.train_data.samples)
    return keeps and rollout_stays_in_store(trainer.config, has_images, trainer.plan)


def logged_rows(rows: int, val_n: int) -> list[int]:
    """The rows whose responses ``val_samples.jsonl`` keeps: the first response of each of the first
    :data:`VAL_SAMPLES_LOGGED` prompts of ``rows`` validation rows (``val_n`` a prompt)."""
    return [prompt * val_n for prompt in range(min(VAL_SAMPLES_LOGGED, rows // val_n))]


def scored_validation(trainer: Any) -> tuple[Batch, list[str]]:
    """``trainer``'s validation rows scored (:meth:`RLTrainer.score`): a ``Batch`` with every
    generated field, or, where :func:`stores_validation`, the stored responses' per-row scalars
    (the blocks released once scored; see the module docstring); and the texts of the
    :func:`logged_rows`' responses."""
    config, rollout = trainer.config, trainer.config.rollout
    count = validation_count(trainer.val_data, config.data.val_max_samples)
    seeds = validation_seeds(count, rollout.val_n, config.trainer.seed)
    if not stores_validation(trainer):
        prompts = trainer.val_data.collate(list(range(count))).repeat(rollout.val_n, interleave=True)
        generated = trainer.generate(prompts, seeds, rollout.val_temperature, validation=True)
        scored = trainer.score(generated, training=False)[0]
        rows = logged_rows(len(scored), rollout.val_n)
        return scored, logged_texts(
            scored, rows, lambda: decode_sampled(trainer.tokenizer, scored["responses"][rows], scored["response_mask"][rows])
        )
    requests = trainer.val_data.requests(list(range(count))).repeat(rollout.val_n, interleave=True)
    sampling = rollout.sampling(rollout.val_temperature, validation=True)
    stored = trainer.rollout.generate_to_store(requests, seeds, sampling, version=trainer.step)
    try:
        scored, _ = trainer.score(stored, training=False)
        assert isinstance(scored, BatchRef)
        rows = logged_rows(len(scored), rollout.val_n)  # agent episodes' decoded by a rank that reads them
        texts = logged_texts(scored, rows, lambda: list(trainer.workers.response_texts(scored[rows])[RESPONSE_TEXT]))
    finally:
        trainer.workers.release_refs(stored)
    return scored.scalars, texts


def logged_texts(scored: Batch | BatchRef, rows: list[int], decode: Callable[[], list[str]]) -> list[str]:
    """The texts of ``rows``' responses: decoded where they were generated (``response_text``),
    else ``decode()`` (their sampled tokens, special tokens dropped: an agent episode's model turns)."""
    if not rows:
        return []
    return [scored[RESPONSE_TEXT][row] for row in rows] if RESPONSE_TEXT in scored else decode()


def row_scores(scored: Batch) -> torch.Tensor:
    """``[B]``: each scored row's score (``sequence_score`` of stored rows, else the row's sum of
    ``token_level_scores``: one score on its last sampled token)."""
    if SEQUENCE_SCORE in scored:
        return scored[SEQUENCE_SCORE]
    return scored["token_level_scores"].sum(-1)


def validation_metrics(scored: Batch, val_n: int) -> dict[str, float]:
    """Accuracy and score per data source of the scored validation responses (a generated ``Batch``
    or a stored one's scalars: :func:`scored_validation`) (``val-core/<source>/acc/mean@<n>``,
    ``val-aux/<source>/score/mean@<n>``) and their mean length."""
    metrics: dict[str, float] = {}
    sources, scores = scored["data_source"], row_scores(scored)
    for source in sorted(set(sources)):
        rows = torch.tensor([s == source for s in sources])
        metrics[f"val-core/{source}/acc/mean@{val_n}"] = float(scored["acc"][rows].mean())
        metrics[f"val-aux/{source}/score/mean@{val_n}"] = float(scores[rows].mean())
    metrics["val-aux/response_length/mean"] = float(response_lengths(scored).float().mean())
    return metrics


def validation_samples(
    scored: Batch, texts: list[str], val_data: RLDataset, tokenizer: Any, val_n: int
) -> list[dict[str, Any]]:
    """The :func:`logged_rows` of the scored validation rows, their responses' ``texts`` beside, with
    their pictures as thumbnails and an agent program's log (``agent_program_log``: its fault, a
    command's output): the rows of the run's ``val_samples.jsonl`` (the report shows them)."""
    samples, scores = [], row_scores(scored)
    for row, text in zip(logged_rows(len(scored), val_n), texts, strict=True):
        prompt = row // val_n
        pictures = val_data.samples[prompt].images
        samples.append(
            {
                "prompt": tokenizer.decode(val_data.samples[prompt].prompt_ids, skip_special_tokens=True),
                "response": text,
                "score": float(scores[row]),
                "ground_truth": str(scored["ground_truth"][row]),
                "images": [thumbnail_url(decode_image(raw)) for raw in pictures.encoded] if pictures else [],
                **(
                    {"program_log": scored["agent_program_log"][row]} if "agent_program_log" in scored else {}
                ),
            }
        )
    return samples

