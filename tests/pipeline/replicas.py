"""Rollout replicas that misbehave on purpose (importable by the spawned replica processes)."""

import os
import random
import signal
import time

from tandem.controller import register
from tandem.pipeline.replica_worker import RolloutReplicaWorker


class DelayedReplica(RolloutReplicaWorker):
    """Holds finished groups back at random and answers late: groups arrive out of order and
    some much later than others (a long tail)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.random = random.Random(self.rank)
        self.held: list = []

    @register(dispatch="ONE_TO_ALL")
    def collect(self, wait_s: float = 0.0, room=None, at_least_one=False):
        groups, idle, waited = super().collect(wait_s, room, at_least_one)
        time.sleep(self.random.uniform(0.0, 0.15))
        pool, self.held, ready = self.held + groups, [], []
        for group in pool:  # each poll reports a finished group with probability 1/2
            (ready if self.random.random() < 0.5 else self.held).append(group)
        return ready, idle, waited


class DyingReplica(RolloutReplicaWorker):
    """Kills its own process when weight version 2 or later arrives: a replica lost in the middle
    of a sync (and again after each restart)."""

    @register(dispatch="ONE_TO_ALL", blocking=False)
    def receive_weights(self, version: int, pause: str = "keep") -> int:
        if version >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().receive_weights(version, pause)


class DyingOnceReplica(RolloutReplicaWorker):
    """Kills its own process when weight version 2 arrives, if the file named by ``DIE_ONCE_FILE``
    exists (it deletes the file first): the replica a restart replaces does not die again."""

    @register(dispatch="ONE_TO_ALL", blocking=False)
    def receive_weights(self, version: int, pause: str = "keep") -> int:
        marker = os.environ.get("DIE_ONCE_FILE", "")
        if version == 2 and marker and os.path.exists(marker):
            os.unlink(marker)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().receive_weights(version, pause)
