"""Errors a user sees as one message rather than a traceback (``tandem`` prints them and exits 2).

Kept free of heavy imports so the command line can name them without loading torch.
"""


class DivergenceError(RuntimeError):
    """Training produced non-finite values; nothing from the failing step was saved."""


class OutputDirInUseError(RuntimeError):
    """Another run holds the output directory."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (the disk is full); the earlier ones are intact."""


class RolloutReplicaError(RuntimeError):
    """A rollout replica of an asynchronous pipeline died, hung or failed; the message names it.

    ``rank``: the replica's rank when one replica is to blame (None otherwise).
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (RolloutReplicaError, (str(self), self.rank))


USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    DivergenceError,
    OutputDirInUseError,
    RolloutReplicaError,
    CheckpointSaveError,
)
