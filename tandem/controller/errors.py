"""Errors that reach the controller from workers."""

from __future__ import annotations


class WorkerError(RuntimeError):
    """An exception raised inside a worker; carries the worker's rank and the remote traceback."""

    def __init__(self, rank: int, method: str, remote_traceback: str) -> None:
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        super().__init__(f"worker rank {rank} raised in {method!r}:\n{remote_traceback}")

    def __reduce__(self):
        return (WorkerError, (self.rank, self.method, self.remote_traceback))


class WorkerDiedError(RuntimeError):
    """A worker process (or Ray actor) died; calls to it fail instead of hanging."""

    def __init__(self, rank: int, detail: str) -> None:
        self.rank = rank
        self.detail = detail
        super().__init__(f"worker rank {rank} died: {detail}")

    def __reduce__(self):
        return (WorkerDiedError, (self.rank, self.detail))
