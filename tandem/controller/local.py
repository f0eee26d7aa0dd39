"""Local backends: one worker in the controller's process, or one spawned process per rank.

On a host without CUDA, worker processes start from a fork server (:func:`worker_context`): a
process that imported the heavy libraries once (torch, tensordict, transformers) and forks each
worker from that state, so a worker starts in about a second instead of re-importing them (5–7 s
each on a 2-core host). The server imports no tandem module. Where CUDA is available workers are
spawned afresh, as the server's imports could initialise the CUDA driver, which a forked process
cannot use (:func:`tandem.device.worker_start_method`). What a spawned child would have taken
from the controller at its start is handed to each worker explicitly instead: the environment,
``sys.path`` and the working directory as they are when the group starts (the server's are from
when it started), and the worker's class and arguments are unpickled only after those are set.

Each rank has a *mailbox* thread on the controller side that runs its calls one at a time,
in submission order. A call's arguments may hold handles (futures) of earlier calls; the
mailbox waits for them, so the controller thread itself never does. Handles are
``concurrent.futures.Future`` objects.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from tandem.config.plugins import plugins_env
from tandem.controller.errors import WorkerDiedError, WorkerError
from tandem.controller.worker import DistInfo, construct_worker, host_rendezvous_store
from tandem.device import worker_start_method

POLL_S = 0.05  # how often a waiting mailbox checks that its worker process is alive
# what the fork server imports once, before forking workers: third-party libraries only (see the
# module docstring); ~90% of a worker's import time on a 2-core host
FORK_SERVER_PRELOAD = ("torch", "tensordict", "transformers", "transformers.modeling_utils")


def worker_context() -> Any:
    """The multiprocessing context worker processes start from: the fork server, preloaded with
    :data:`FORK_SERVER_PRELOAD`, or, on a host with CUDA, ``spawn``
    (:func:`tandem.device.worker_start_method` decides)."""
    method = worker_start_method()
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(FORK_SERVER_PRELOAD))  # read when the server first starts
    return context


def parent_state() -> dict[str, Any]:
    """What a spawned child would take from this process at its start: the environment, ``sys.path``
    and the working directory, as they are now (:func:`take_parent_state` applies them)."""
    return {"env": dict(os.environ), "sys_path": list(sys.path), "cwd": os.getcwd()}


def take_parent_state(state: dict[str, Any]) -> None:
    """Make this (forked) process's environment, ``sys.path`` and working directory the parent's."""
    os.environ.clear()
    os.environ.update(state["env"])
    sys.path[:] = state["sys_path"]
    os.chdir(state["cwd"])


def _resolve(value: Any) -> Any:
    return value.result() if isinstance(value, Future) else value


class _Mailbox:
    """Runs ``execute(method, args, kwargs)`` for one rank on a private thread, in order."""

    def __init__(self, rank: int, execute: Callable[[str, tuple, dict], Any], name: str) -> None:
        self.rank = rank
        self._execute = execute
        self._queue: queue.Queue = queue.Queue()
        self._running = threading.Lock()  # one call at a time, on whichever thread runs it
        self._pending = 0  # submitted and not finished
        self._count = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, method: str, args: tuple, kwargs: dict) -> Future:
        future: Future = Future()
        with self._count:
            self._pending += 1
        self._queue.put((future, method, args, kwargs))
        return future

    def run_here(self, method: str, args: tuple, kwargs: dict) -> Future:
        """Run on the caller's thread when nothing is queued before it (else queue it).

        A blocking call gains nothing from the mailbox thread, and keeping the compute on the
        controller's thread keeps one OpenMP team busy instead of two competing for the cores.
        """
        with self._count:
            idle = self._pending == 0
        if not idle:
            return self.submit(method, args, kwargs)
        future: Future = Future()
        with self._running:
            self._call(future, method, args, kwargs)
        return future

    def _call(self, future: Future, method: str, args: tuple, kwargs: dict) -> None:
        try:
            args = tuple(_resolve(a) for a in args)
            kwargs = {k: _resolve(v) for k, v in kwargs.items()}
            future.set_result(self._execute(method, args, kwargs))
        except BaseException as error:  # delivered to whoever waits on the future
            future.set_exception(error)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, method, args, kwargs = item
            with self._running:
                self._call(future, method, args, kwargs)
            with self._count:
                self._pending -= 1

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread after the calls already queued (waits up to ``timeout_s`` for it)."""
        self._queue.put(None)
        if timeout_s > 0:
            self._thread.join(timeout=timeout_s)


class _LocalBackendBase:
    world_size: int
    _mailboxes: list[_Mailbox]

    def submit(self, rank: int, method: str, args: tuple, kwargs: dict) -> Future:
        return self._mailboxes[rank].submit(method, args, kwargs)

    def result(self, rank: int, handle: Future, timeout: float | None) -> Any:
        try:
            return handle.result(timeout=timeout)
        except FutureTimeout:
            raise TimeoutError(f"worker rank {rank} did not answer within {timeout} s") from None

    def done(self, handle: Future) -> bool:
        return handle.done()

    def is_handle(self, value: Any) -> bool:
        return isinstance(value, Future)

    def derive(self, handles: list, fn: Callable[[list], Any]) -> Future:
        """A future of ``fn([results of handles])``, computed on a helper thread when they finish."""
        derived: Future = Future()

        def wait_and_apply() -> None:
            try:
                derived.set_result(fn([h.result() for h in handles]))
            except BaseException as error:
                derived.set_exception(error)

        threading.Thread(target=wait_and_apply, name="tandem-derive", daemon=True).start()
        return derived


class InProcessBackend(_LocalBackendBase):
    """A single worker living in the controller's process (world size 1): non-blocking calls run on
    a mailbox thread, blocking ones on the caller's thread."""

    same_process = True  # arguments reach the worker as the objects themselves

    def __init__(self, worker_cls: type, args: tuple = (), kwargs: dict | None = None) -> None:
        self.world_size = 1
        self.worker = construct_worker(
            worker_cls, DistInfo(), args, kwargs or {}
        )  # a world of one meets no one
        self._mailboxes = [_Mailbox(0, self._run, "tandem-worker-0")]

    @property
    def host_pids(self) -> list[int]:
        """The group's processes on this host: this one."""
        return [os.getpid()]

    def _run(self, method: str, args: tuple, kwargs: dict) -> Any:
        return self.worker._tandem_execute(method, *args, **kwargs)

    def submit_here(self, rank: int, method: str, args: tuple, kwargs: dict) -> Future:
        """A blocking call: run it on the caller's thread (see :meth:`_Mailbox.run_here`)."""
        return self._mailboxes[rank].run_here(method, args, kwargs)

    def shutdown(self) -> None:
        for mailbox in self._mailboxes:
            mailbox.stop()
        self._mailboxes = []


def _process_main(conn: Any, state: dict[str, Any], worker: bytes, env: dict[str, str]) -> None:
    """Entry point of a worker process: take the controller's ``state`` (:func:`parent_state`) and
    the rank's ``env``, unpickle ``worker`` (its class, arguments and keyword arguments), build the
    worker, then serve calls until told to stop.

    The controller starts workers as daemons (they end with it), and Python forbids a daemon to
    start processes of its own; a worker's engine may need to (vLLM runs its engine core in a
    child process), so the worker clears the flag on its side. The worker leads a process group of
    its own, which its children join: the controller's shutdown ends the whole group, so even a
    worker killed outright leaves no engine process behind (and Ctrl-C reaches the controller
    alone, which then stops the workers).
    """
    multiprocessing.current_process()._config["daemon"] = False  # noqa: SLF001 (see the docstring)
    os.setpgid(0, 0)
    take_parent_state(state)
    os.environ.update(env)
    rank = int(env["RANK"])
    name = "the worker"
    try:
        worker_cls, args, kwargs = pickle.loads(worker)
        name = worker_cls.__name__
        worker = construct_worker(worker_cls, DistInfo.from_env(), args, kwargs)
    except BaseException:
        conn.send(("error", WorkerError(rank, f"{name}.__init__", traceback.format_exc())))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the controller went away
            return
        if message[0] == "stop":
            return
        _, method, call_args, call_kwargs = message
        try:
            reply = ("ok", worker._tandem_execute(method, *call_args, **call_kwargs))
        except WorkerError as error:
            reply = ("error", error)
        try:
            conn.send(reply)
        except Exception:  # e.g. an unpicklable result
            conn.send(("error", WorkerError(rank, method, traceback.format_exc())))


class ProcessBackend(_LocalBackendBase):
    """One spawned process per rank on this machine, joined by a loopback rendezvous address."""

    def __init__(
        self, worker_cls: type, world_size: int, args: tuple = (), kwargs: dict | None = None
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self._context = worker_context()
        self._worker = pickle.dumps((worker_cls, args, kwargs or {}))  # unpickled in the worker (see _process_main)
        # the ranks meet here, for the group's lifetime (a world of one meets no one)
        self._store = host_rendezvous_store() if world_size > 1 else None
        port = self._store.port if self._store is not None else 0
        self._infos = [DistInfo(r, world_size, r, world_size, "127.0.0.1", port) for r in range(world_size)]
        self._processes, self._conns = [], []
        for rank in range(world_size):
            process, conn = self._spawn(rank)
            self._processes.append(process)
            self._conns.append(conn)
        for rank in range(world_size):  # wait for every constructor; report the first failure
            status, payload = self._receive(rank)
            if status == "error":
                self.shutdown()
                raise payload
        self._mailboxes = [_Mailbox(r, self._caller(r), f"tandem-mailbox-{r}") for r in range(world_size)]

    def _spawn(self, rank: int) -> tuple[Any, Any]:
        """Start rank ``rank``'s process; returns it and the controller's end of its pipe."""
        parent, child = self._context.Pipe()
        process = self._context.Process(
            target=_process_main,
            args=(child, parent_state(), self._worker, {**self._infos[rank].as_env(), **plugins_env()}),
            name=f"tandem-worker-{rank}",
            daemon=True,
        )
        process.start()
        child.close()
        return process, parent

    def restart(self, rank: int) -> None:
        """Replace rank ``rank``'s process by a fresh one built with the group's arguments (the old
        one is killed if it still runs). Calls queued for the old process fail as it is gone; the
        new one takes calls submitted from now on. Raises what its constructor raised.

        Meant for workers that share no process group (rollout replicas): the new process does
        not rejoin a collective group its peers formed.
        """
        _kill_process_tree(self._processes[rank])
        process, conn = self._spawn(rank)
        self._processes[rank], self._conns[rank] = process, conn
        status, payload = self._receive(rank)
        if status == "error":
            raise payload
        self._mailboxes[rank].stop(timeout_s=0.0)  # its queued calls fail against the dead process
        self._mailboxes[rank] = _Mailbox(rank, self._caller(rank), f"tandem-mailbox-{rank}")

    def _receive(self, rank: int, conn: Any = None, process: Any = None) -> tuple[str, Any]:
        conn = conn or self._conns[rank]
        process = process or self._processes[rank]
        while not conn.poll(POLL_S):
            if not process.is_alive():
                raise WorkerDiedError(rank, f"process {process.pid} exited with code {process.exitcode}")
        try:
            return conn.recv()
        except (EOFError, OSError):
            process.join(timeout=1)
            raise WorkerDiedError(
                rank, f"process {process.pid} closed its pipe (exit code {process.exitcode})"
            ) from None

    def _caller(self, rank: int) -> Callable[[str, tuple, dict], Any]:
        """Calls to rank ``rank``'s current process (bound to it: a restart does not redirect them)."""
        conn, process = self._conns[rank], self._processes[rank]

        def call(method: str, args: tuple, kwargs: dict) -> Any:
            try:
                conn.send(("call", method, args, kwargs))
            except (BrokenPipeError, OSError):
                raise WorkerDiedError(rank, f"process {process.pid} is gone") from None
            status, payload = self._receive(rank, conn, process)
            if status == "error":
                raise payload
            return payload

        return call

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    @property
    def host_pids(self) -> list[int]:
        """The group's processes on this host: all of them."""
        return self.pids

    def shutdown(self, grace_s: float = 3.0) -> None:
        """Ask every process to stop, kill the ones still busy after ``grace_s``, then stop the mailboxes."""
        for conn, process in zip(self._conns, self._processes, strict=True):
            if process.is_alive():
                with contextlib.suppress(
                    BrokenPipeError, OSError
                ):  # it may die between the check and the send
                    conn.send(("stop",))
        deadline = time.monotonic() + grace_s
        for process in self._processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            _kill_process_tree(process)
        for mailbox in getattr(self, "_mailboxes", []):
            mailbox.stop()
        for conn in self._conns:
            conn.close()
        self._mailboxes, self._conns, self._processes = [], [], []
        self._store = None


def _kill_process_tree(process: Any) -> None:
    """Kill ``process`` if it still runs, and what it started (its process group; see ``_process_main``)."""
    if process.is_alive():
        process.kill()
        process.join(timeout=5)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
