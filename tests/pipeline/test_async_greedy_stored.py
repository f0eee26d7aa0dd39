"""ReMax in the asynchronous pipelines with ``dataplane.enabled``: the greedy responses stay in the
rollout replicas' blocks, as the draws do. Each replica generates its share of the step's prompts,
puts the rows into its own store and sends back a ``BatchRef`` with the rows' scalars and decoded
texts; the controller scores those and releases the blocks, so no greedy token reaches it. The run's
metrics equal the data plane's off path (the replicas return the greedy completions and the
controller builds their padded batch) step for step on a fixed seed, to float32 rounding (the
groups' order in a draw follows the replica's timing)."""

from pathlib import Path

import pytest

from tandem.dataplane import BatchRef, traffic
from tandem.pipeline.stored_rollout import RESPONSE_TEXT
from tandem.protocol import Batch
from tandem.protocol.sequences import RESPONSE_LENGTH, decode_responses, response_lengths
from tests.pipeline.test_async_dataplane import MODES, TWO_CORES, ReplicaRecordingTrainer, _files_of
from tests.rl.conftest import assert_same_histories, small_config
from tests.rl.test_dataplane_step import TOKEN_COLUMNS, assert_draws_stay_stored


class GreedyRecordingTrainer(ReplicaRecordingTrainer):
    """Also keeps each step's greedy responses as the controller scored them (a ``Batch`` or a
    ``BatchRef``), what the controller put into, fetched from and released in the data plane while
    drawing (the draw, its scores and its greedy baselines), and which of the greedy blocks were
    still there once the draw was done."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.greedy: list[Batch | BatchRef] = []
        self.draw_traffic: list = []
        self.greedy_left: list[list[str]] = []

    def score(self, batch, training=True):
        if not training:  # no validation in these runs: the greedy baselines
            self.greedy.append(batch)
        return super().score(batch, training)

    def scored_draw(self, draw, timings):
        start = traffic()
        result = super().scored_draw(draw, timings)
        self.draw_traffic.append(traffic() - start)
        greedy = self.greedy[-1]
        blocks = greedy.blocks() if isinstance(greedy, BatchRef) else []
        self.greedy_left.append([b.path for b in blocks if Path(b.path).exists()])
        return result


def _run(rl_files, out, *overrides):
    trainer = GreedyRecordingTrainer(
        small_config(rl_files, out, "data.val_path=", "preset=remax", *TWO_CORES, *overrides)
    )
    return trainer.fit().history, trainer


def _comparable(history):  # a block's bytes are not a sample file's: the byte metrics differ
    return [{k: v for k, v in h.items() if not k.startswith("pipeline/inflight")} for h in history]


def _assert_greedy_stays_on_the_replicas(today, refs, replicas: int) -> None:
    steps = len(refs.greedy)
    # today: the greedy responses' token ids reach the controller, which builds their padded batch
    assert all(isinstance(g, Batch) and "responses" in g for g in today.greedy)
    token_bytes = [sum(g[k].nbytes for k in TOKEN_COLUMNS) for g in today.greedy]
    # the data plane: references to the replicas' blocks, one block a replica, no token id inline
    assert len(today.greedy) == steps
    for greedy, batch in zip(refs.greedy, today.greedy, strict=True):
        assert isinstance(greedy, BatchRef) and len(greedy.blocks()) == replicas
        assert set(TOKEN_COLUMNS) <= set(greedy.stored_fields())
        assert not set(TOKEN_COLUMNS) & set(greedy.scalars.keys()) and "prompt_ids" not in greedy.scalars
        # the same prompts' greedy responses as the controller would decode them (the groups' order
        # in a draw is the order they finished in: with two replicas it may differ between runs)
        lengths = response_lengths(batch)
        texts = decode_responses(today.tokenizer, batch["responses"], lengths)
        expected = dict(zip(batch["index"], zip(texts, lengths.tolist(), strict=True), strict=True))
        got = zip(greedy[RESPONSE_TEXT], greedy[RESPONSE_LENGTH].tolist(), strict=True)
        assert dict(zip(greedy["index"], got, strict=True)) == expected
    n = refs.config.rollout.n
    for run in (today, refs):  # each greedy row is its draw's group's (the references' order)
        assert [list(g["index"]) for g in run.greedy] == [list(d["index"][::n]) for d in run.draws]
    for used in refs.draw_traffic:  # the controller put and fetched nothing; it released the greedy blocks
        assert used.put_bytes == used.fetched_bytes == 0
        assert used.blocks_released == replicas
    assert refs.greedy_left == [[]] * steps  # released once scored
    assert_draws_stay_stored(refs)
    assert refs.step_bytes == [0] * steps and refs.left == [[]] * steps
    assert not _files_of(refs.replica_pids)
    print(f"greedy token bytes on the controller a step: today {token_bytes}, refs 0")


def test_one_step_off_remax_keeps_its_greedy_responses_on_the_replica(rl_files, tmp_path):
    """Two one-step-off ReMax steps, one replica: metrics equal to float32 rounding, no greedy token
    on the controller. Not bit for bit: the greedy requests join the groups already in flight on the
    replica, so the order its groups finish in (a draw's row order, and the sums over rows with it)
    follows the engine's timing, which differs between runs (seen in CI: `critic/rewards/mean`
    0.14166668 vs 0.14166666)."""
    off, today = _run(rl_files, tmp_path / "off", "dataplane.enabled=false", *MODES["one_step_off"])
    on, refs = _run(rl_files, tmp_path / "on", *MODES["one_step_off"], "dataplane.enabled=true")
    assert_same_histories(_comparable(off), _comparable(on))
    _assert_greedy_stays_on_the_replicas(today, refs, replicas=1)


@pytest.mark.slow  # two 3-step runs per mode with two replica processes each, on 2 cores
@pytest.mark.parametrize("mode", list(MODES))
def test_remax_keeps_its_greedy_responses_on_two_replicas(rl_files, tmp_path, mode):
    """Three steps over two replicas: each generates every other prompt's greedy response, and the
    references come back in the prompts' order. The metrics agree to float32 rounding, not bit for
    bit: with two replicas a draw's groups come in the order they finished, which may differ between
    the runs, and the sums over rows with it (GRPO's too, without greedy baselines)."""
    overrides = (*MODES[mode], "pipeline.rollout_replicas=2", "trainer.total_steps=3")
    off, today = _run(rl_files, tmp_path / "off", "dataplane.enabled=false", *overrides)
    on, refs = _run(rl_files, tmp_path / "on", *overrides, "dataplane.enabled=true")
    assert_same_histories(_comparable(off), _comparable(on))
    _assert_greedy_stays_on_the_replicas(today, refs, replicas=2)
