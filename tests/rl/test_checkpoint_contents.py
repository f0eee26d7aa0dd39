"""The controller's part of an RL checkpoint: what it saves comes back on resume."""

import json
import random

from tandem.rl.checkpoint_contents import restore_python_random, trainer_state
from tandem.run.sampler import EpochSampler


class FixedKL:
    value = 0.1


def test_pythons_random_stream_continues_after_a_resume_as_if_uninterrupted():
    random.seed(1234)
    random.random()
    state = json.loads(json.dumps(trainer_state(3, EpochSampler(8, seed=0), FixedKL())))  # as on disk
    uninterrupted = [random.random() for _ in range(5)]

    random.seed(999)  # a fresh process's stream
    restore_python_random(state)
    assert [random.random() for _ in range(5)] == uninterrupted


def test_a_checkpoint_without_pythons_random_state_leaves_it_alone():
    random.seed(7)
    expected = random.getstate()
    restore_python_random({"step": 1})
    assert random.getstate() == expected
