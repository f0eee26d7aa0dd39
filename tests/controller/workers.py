"""Worker classes the controller tests run (importable, so spawned processes and Ray actors can load them)."""

import multiprocessing
import os
import subprocess
import threading
import time

import torch
import torch.distributed as dist

from tandem.controller import Worker, mesh_dispatch, register
from tandem.protocol import Batch


def all_reduced(worker: Worker, value: float) -> float:
    """The sum over the group's ranks of ``value * (rank + 1)``, joining the gloo group first."""
    worker.init_process_group("gloo")
    tensor = torch.tensor([value * (worker.rank + 1)])
    dist.all_reduce(tensor)
    return float(tensor.item())


class EchoWorker(Worker):
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.delay_s = 0.0
        self.calls: list[str] = []

    @register(dispatch="ONE_TO_ALL")
    def whoami(self) -> tuple[int, int, int]:
        return self.rank, self.world_size, os.getpid()

    @register(dispatch="ONE_TO_ALL")
    def visible_gpus(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    @register(dispatch="ONE_TO_ALL")
    def rendezvous_port(self) -> int:
        return self.dist_info.master_port

    @register(dispatch="ONE_TO_ALL")
    def set_delay(self, seconds: float) -> None:
        self.delay_s = seconds

    @register(dispatch="DP_COMPUTE")
    def double(self, batch: Batch) -> Batch:
        return self._double(batch)

    @register(dispatch="DP_COMPUTE", blocking=False)
    def double_later(self, batch: Batch) -> Batch:
        time.sleep(self.delay_s)
        self.calls.append("double_later")
        return self._double(batch)

    @register(dispatch="DP_COMPUTE", blocking=False)
    def add_one_later(self, batch: Batch) -> Batch:
        self.calls.append("add_one_later")
        return batch.assign(tensors={"y": batch["y"] + 1})

    def _double(self, batch: Batch) -> Batch:
        ranks = torch.full((len(batch),), self.rank, dtype=torch.long)
        return batch.assign(tensors={"y": batch["x"] * 2 * self.scale, "rank": ranks})

    @register(dispatch="ONE_TO_ALL")
    def sum_of(self, batch: Batch) -> tuple[int, float]:
        return len(batch), float(batch["x"].sum())

    @register(dispatch="ONE_TO_ALL")
    def thread_id(self) -> int:
        self.calls.append("thread_id")
        return threading.get_ident()

    @register(dispatch="ONE_TO_ALL")
    def call_log(self) -> list[str]:
        return list(self.calls)

    @register(dispatch="ALL_TO_ALL")
    def add_rank(self, value: int, offset: int = 0) -> int:
        return value + self.rank + offset

    @register(dispatch="RANK_ZERO")
    def rank_zero_only(self) -> int:
        return self.rank

    @register(dispatch="ONE_TO_ALL", execute="rank_zero")
    def executed_on_zero(self) -> int:
        return self.rank

    @register(dispatch="ONE_TO_ALL")
    def all_reduce(self, value: float) -> float:
        return all_reduced(self, value)

    @register(dispatch="ONE_TO_ALL")
    def fail(self, message: str) -> None:
        if self.rank == self.world_size - 1:
            raise ValueError(message)

    @register(dispatch="ONE_TO_ALL")
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(dispatch="ONE_TO_ALL")
    def join_mesh(self, tp_size: int) -> None:
        self.set_mesh_rank(
            "tp",
            dp_rank=self.rank // tp_size,
            dp_size=self.world_size // tp_size,
            is_collect=self.rank % tp_size == 0,
        )

    @register(dispatch=mesh_dispatch("tp"))
    def mesh_double(self, batch: Batch) -> Batch:
        return self._double(batch)


class ParentWorker(Worker):
    """Starts processes of its own, as an engine such as vLLM does."""

    @register(dispatch="ONE_TO_ALL")
    def start_children(self) -> list[int]:
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
        child.start()  # a daemon's child: allowed because the worker clears its daemon flag
        self.children = [child, subprocess.Popen(["sleep", "120"])]
        return [os.getpid(), child.pid, self.children[1].pid]


class ActorRole(Worker):
    def __init__(self, lr: float) -> None:
        self.lr = lr
        self.weights = torch.zeros(3)

    @register(dispatch="ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch="ONE_TO_ALL")
    def step(self) -> float:
        self.weights += self.lr
        return float(self.weights.sum())


class RolloutRole(Worker):
    def __init__(self) -> None:
        self.version = 0

    @register(dispatch="ONE_TO_ALL")
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch="ONE_TO_ALL")
    def rank_seen(self) -> int:
        return self.rank

    @register(dispatch="ONE_TO_ALL")
    def all_reduce(self, value: float) -> float:
        """A role, not the process's fused worker, joins the group (as the RL workers do)."""
        return all_reduced(self, value)

    @register(dispatch="DP_COMPUTE")
    def generate(self, batch: Batch) -> Batch:
        return batch.assign(tensors={"y": batch["x"] + self.version})


class BrokenWorker(Worker):
    def __init__(self) -> None:
        raise RuntimeError("cannot build this worker")


class ParentStateWorker(Worker):
    """Reports what it took from the controller at its start: an environment variable, the working
    directory, and whether a module on the controller's ``sys.path`` imports."""

    def __init__(self, variable: str, module: str) -> None:
        self.variable, self.module = variable, module

    @register(dispatch="ONE_TO_ALL")
    def state(self) -> tuple[str | None, str, bool]:
        import importlib.util

        return os.environ.get(self.variable), os.getcwd(), importlib.util.find_spec(self.module) is not None
