"""The asynchronous modes' policies in isolation: over a scripted run (the pipeline starts, draws
take groups, the trainer updates), which events sync the weights, with which pause, and how many
prompt groups have been handed out after each, against tables worked out by hand from the rules
of docs/pipelines.md. The executor below does what ``AsyncRollout._act`` does."""

import dataclasses

import pytest

from tandem.pipeline.async_policy import Action, FullyAsync, OneStepOff, async_policy
from tandem.pipeline.config import PipelineConfig

GROUPS = 2  # prompt groups a draw


class Executor:
    """A pipeline reduced to its two counters: the replicas' weight version and the groups handed out."""

    def __init__(self, policy):
        self.policy = policy
        self.rollout_version = 0
        self.handed_out = 0
        self.dropped_stale = 0

    def act(self, action: Action, version: int) -> tuple:
        if action.sync is not None:
            self.rollout_version = version
        if action.hand_out:
            allowed = self.policy.allowance(self.rollout_version, self.dropped_stale)
            self.handed_out += max(allowed - self.handed_out, 0)
        return action.sync, action.drain, self.handed_out, self.rollout_version

    def run(self, script: list[tuple]) -> list[tuple]:
        """``script``: ``("start", v)``, ``("draw", step, draw)`` (a ``drawing`` then a ``taken``
        row), ``("update", v)``, ``("drop", k)`` (the queue drops ``k`` groups as too stale)."""
        rows, trainer = [], 0
        for event, *args in script:
            if event == "start":
                trainer = args[0]
                rows.append(("start", *self.act(self.policy.start(trainer), trainer)))
            elif event == "draw":
                trainer = args[0] - 1
                rows.append(("drawing", *self.act(self.policy.drawing(args[1]), trainer)))
                taken = self.policy.taken(self.rollout_version, trainer)
                rows.append(("taken", *self.act(taken, trainer)))
            elif event == "update":
                trainer = args[0]
                rows.append(("update", *self.act(self.policy.updated(trainer), trainer)))
            else:
                self.dropped_stale += args[0]
        return rows


def test_one_step_off_syncs_the_idle_replicas_once_a_step_and_hands_out_one_draw_ahead():
    rows = Executor(OneStepOff(GROUPS)).run(
        [
            ("start", 0),
            ("draw", 1, 1),
            ("update", 1),
            ("draw", 2, 1),
            ("draw", 2, 2),
            ("update", 2),
            ("draw", 3, 1),
        ]
    )
    # event, sync pause, drained first, groups handed out so far, replicas' version
    assert rows == [
        ("start", None, False, 2, 0),  # draw 1's groups
        ("drawing", None, False, 2, 0),
        ("taken", None, False, 4, 0),  # the replicas already hold version 0: no sync; draw 2 goes out
        ("update", None, False, 4, 0),  # one-step-off never syncs at an update
        ("drawing", None, False, 4, 0),
        ("taken", "keep", True, 6, 1),  # behind the trainer: drain, sync 1, then the next draw
        ("drawing", None, False, 6, 1),  # a second draw (dynamic sampling) of step 2
        ("taken", None, False, 8, 1),
        ("update", None, False, 8, 1),
        ("drawing", None, False, 8, 1),
        ("taken", "keep", True, 10, 2),
    ]
    assert OneStepOff(GROUPS).staleness_threshold is None  # nothing is dropped
    assert OneStepOff(GROUPS).restart_pause == "wait"


def test_fully_async_hands_out_within_the_staleness_bound_and_syncs_on_schedule():
    pipeline = PipelineConfig(
        mode="fully_async", staleness_threshold=1, trigger_parameter_sync_step=2, partial_rollout=True
    )
    policy = async_policy(pipeline, GROUPS)
    rows = Executor(policy).run(
        [
            ("start", 0), ("draw", 1, 1), ("update", 1), ("draw", 2, 1), ("drop", 1), ("update", 2),
            ("draw", 3, 1), ("draw", 3, 2), ("update", 3), ("update", 4),
        ]
    )  # fmt: skip
    # allowance = (rollout version - start version + threshold + 1) * groups + dropped + redrawn
    assert rows == [
        ("start", None, False, 4, 0),  # (0 + 1 + 1) * 2
        ("drawing", None, False, 4, 0),
        ("taken", None, False, 4, 0),
        ("update", None, False, 4, 0),  # 1 % 2: no sync, the bound has not moved
        ("drawing", None, False, 4, 0),
        ("taken", None, False, 4, 0),
        ("update", "keep", False, 9, 2),  # sync 2 (partial rollout: keep), (2 + 2) * 2 + 1 dropped
        ("drawing", None, False, 9, 2),
        ("taken", None, False, 9, 2),
        ("drawing", None, False, 11, 2),  # a second draw: its 2 groups are replaced at once
        ("taken", None, False, 11, 2),
        ("update", None, False, 11, 2),
        ("update", "keep", False, 15, 4),  # (4 + 2) * 2 + 1 + 2
    ]
    assert policy.staleness_threshold == 1 and policy.restart_pause == "keep"


def test_fully_async_resumed_counts_from_the_trainers_version_and_waits_without_partial_rollout():
    pipeline = PipelineConfig(
        mode="fully_async", staleness_threshold=0, trigger_parameter_sync_step=1, partial_rollout=False
    )
    policy = FullyAsync(GROUPS, pipeline)
    rows = Executor(policy).run([("start", 5), ("draw", 6, 1), ("update", 6)])
    assert rows == [
        ("start", "abort", False, 2, 5),  # a resumed run's replicas get its weights first; (0 + 0 + 1) * 2
        ("drawing", None, False, 2, 5),
        ("taken", None, False, 2, 5),
        ("update", "wait", False, 4, 6),  # running requests finish on the old weights first
    ]
    assert policy.restart_pause == "wait"


def test_one_step_off_resumed_syncs_first():
    assert OneStepOff(GROUPS).start(3) == Action(sync="abort", hand_out=True)


def test_the_sync_mode_has_no_async_policy():
    with pytest.raises(ValueError, match="pipeline.mode=sync"):
        async_policy(dataclasses.replace(PipelineConfig(), mode="sync"), GROUPS)
