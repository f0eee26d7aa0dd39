"""Validation with ``dataplane.enabled``: the responses to the validation prompts stay where they
were generated, as the draws do (:func:`tandem.rl.validation.scored_validation`). The request names
each prompt's place in the validation file (no token id), the ranks (``sync``) or the rollout
replicas (asynchronous modes) read the rows, generate, put the responses into their blocks and send
back only per-row scalars and the decoded texts; the controller scores those, puts and fetches no
stored byte and releases the blocks. Against the ``Batch`` path (the prompts collated on the
controller, every generated sequence returned to it): the same validation metrics and the same
``val_samples.jsonl``, on a validation set whose first prompt is wider than every training prompt
(the stored draws' width covers it) and whose rows come from two data sources.
"""

import json
from pathlib import Path

import pytest

from tandem.data import write_parquet
from tandem.dataplane import BatchRef, traffic
from tandem.protocol import Batch
from tandem.protocol.fields import PROMPT_PLACE
from tandem.rl import RLTrainer
from tandem.rl.data import ArithmeticTaskConfig, arithmetic_rows
from tests.pipeline.test_async_dataplane import MODES, TWO_CORES, _files_of
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import TOKEN_COLUMNS

WIDER = " 11+22=33 44+55=99 12+34=46 21+43=64 "  # the tiny model's characters


class ValidationRecorder(RLTrainer):
    """Records each validation's scored rows (a ``Batch`` or a ``BatchRef``), the requests the
    source was sent, what this process put and fetched in the data plane during it, the scored
    rows' block files left after it, and the run's processes (to look for their block files once
    it has ended)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.scored: list[Batch | BatchRef] = []
        self.requests: list[Batch] = []
        self.used: list = []
        self.left: list[list[str]] = []  # the scored rows' block files still there after each validation
        self.pids: set[int] = set()

    def score(self, batch, training=True):
        if not training:
            self.scored.append(batch)
        return super().score(batch, training)

    def validate(self):
        self.pids |= {*self.rollout.host_pids(), *self.workers.backend.host_pids}
        keeps = self.rollout.generate_to_store  # the stored path's one call to the source: note its requests

        def recorded(requests, *args, **kwargs):
            self.requests.append(requests)
            return keeps(requests, *args, **kwargs)

        self.rollout.generate_to_store, start = recorded, traffic()
        try:
            metrics = super().validate()
        finally:
            del self.rollout.generate_to_store
        self.used.append(traffic() - start)
        scored = self.scored[-1]
        blocks = scored.blocks() if isinstance(scored, BatchRef) else []
        self.left.append([block.path for block in blocks if Path(block.path).exists()])
        return metrics


@pytest.fixture(scope="module")
def val_files(rl_files, tmp_path_factory):
    """``rl_files`` with a validation set of 6 prompts: two data sources, the first prompt wider
    than every training prompt."""
    rows = arithmetic_rows(6, ArithmeticTaskConfig(max_digits=2), seed=3, split="test")
    rows[0]["prompt"][-1]["content"] += WIDER
    for row in rows[1::2]:
        row["data_source"] = "arithmetic_other"
    val = write_parquet(rows, tmp_path_factory.mktemp("val") / "val.parquet")
    return {**rl_files, "val": str(val)}


def _run(files, out, *overrides):
    config = small_config(
        files, out, "trainer.total_steps=1", "rollout.val_n=2", "rollout.val_temperature=1.0", *overrides
    )
    trainer = ValidationRecorder(config)
    result = trainer.fit()
    return result, trainer


def _val_samples(result) -> list[dict]:
    return [json.loads(line) for line in (result.output_dir / "val_samples.jsonl").read_text().splitlines()]


def _assert_validation_stays_stored(
    today: ValidationRecorder, refs: ValidationRecorder, blocks: int, rank_here_reads: tuple[str, ...] = ()
) -> None:
    """Today's validations returned every generated sequence; the data plane's returned references
    to ``blocks`` blocks (one a rank or replica), asked for by place, and moved no stored byte
    (``rank_here_reads``: but for these fields, which a trainer rank in this process reads)."""
    assert len(today.scored) == len(refs.scored) == 2  # before the first step and after the last
    assert all(isinstance(s, Batch) and "responses" in s for s in today.scored)
    for scored, batch, requests in zip(refs.scored, today.scored, refs.requests, strict=True):
        assert isinstance(scored, BatchRef) and len(scored.blocks()) == blocks
        assert set(TOKEN_COLUMNS) <= set(scored.stored_fields())
        assert not set(TOKEN_COLUMNS) & set(scored.scalars.keys())
        assert PROMPT_PLACE in requests.keys() and "prompt_ids" not in requests.keys()
        assert list(scored["index"]) == list(batch["index"])
    for used in refs.used:  # nothing put or fetched here
        assert used.put_bytes == 0 and set(used.fetched_by_field) <= set(rank_here_reads)
        assert used.fetched_bytes == 0 or rank_here_reads
    assert refs.left == [[], []]  # every block released once scored
    assert not _files_of(refs.pids)


def test_sync_validation_stays_on_the_ranks_and_scores_like_todays_path(val_files, tmp_path):
    """``sync``, two ranks (worker processes): the validation metrics and samples bit for bit, the
    step's metrics too."""
    off, today = _run(val_files, tmp_path / "off", "dataplane.enabled=false", "trainer.n_workers=2")
    on, refs = _run(val_files, tmp_path / "on", "trainer.n_workers=2")
    assert on.validation == off.validation
    assert {"val-core/arithmetic/acc/mean@2", "val-core/arithmetic_other/acc/mean@2"} <= set(on.validation)
    assert _val_samples(on) == _val_samples(off)
    widest_training_prompt = max(len(s.prompt_ids) for s in refs.train_data.samples)
    assert len(refs.val_data.samples[0].prompt_ids) > widest_training_prompt
    assert WIDER.strip() in _val_samples(on)[0]["prompt"]
    assert_same_histories(off.history, on.history, relative=0.0)
    _assert_validation_stays_stored(today, refs, blocks=2)


@pytest.mark.parametrize(
    "mode", ["one_step_off", pytest.param("fully_async", marks=pytest.mark.slow)]
)  # slow: a second run of the same replica path
def test_async_validation_stays_on_the_replicas_and_scores_like_todays_path(val_files, tmp_path, mode):
    """One replica: the validation responses are generated there under the trainer's newest
    weights, read by place, stored in its blocks; the metrics and samples equal the off path's."""
    overrides = (*TWO_CORES, *MODES[mode])
    off, today = _run(val_files, tmp_path / "off", "dataplane.enabled=false", *overrides)
    on, refs = _run(val_files, tmp_path / "on", *overrides)
    assert on.validation == pytest.approx(off.validation, rel=1e-6)
    assert _val_samples(on) == _val_samples(off)
    _assert_validation_stays_stored(today, refs, blocks=1)
