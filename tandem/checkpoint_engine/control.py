"""The control plane: bucket metadata and acknowledgements through a ``torch.distributed.TCPStore``.

The sender (trainer rank 0) hosts the store; each receiver connects to its address. Per weight
version ``v`` the sender publishes ``v/<k>/meta`` for bucket ``k`` once its bytes are on their
way, and receivers of flow-controlled transports set ``v/<k>/ack/<r>`` when done with it. The
store carries only these small strings: tensors travel by the transport.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import time

import torch.distributed as dist

from tandem.checkpoint_engine.buckets import BucketMeta

WAIT_SLICE_S = 5.0  # waits are cut into slices so a timeout can name what is missing

_exiting = threading.Event()
_waits_lock = threading.Lock()
_waits_in_progress = 0


@atexit.register
def _release_waits_at_exit() -> None:
    """Let waits still running on daemon threads end before the interpreter finalizes.

    A trainer thread can be left waiting for a replica that died (the run was stopped without
    ceremony). A thread that comes back from the store's C++ wait while Python is finalizing
    aborts the whole process (exit status 134, after every test passed). At exit, waits stop at
    their next slice: this waits up to one slice for them to leave.
    """
    _exiting.set()
    deadline = time.monotonic() + WAIT_SLICE_S + 1.0
    while _waits_in_progress and time.monotonic() < deadline:
        time.sleep(0.05)


class ControlPlane:
    """One side's connection to the store at ``host:port`` (``is_sender`` hosts it; port 0 lets
    the sender's store bind a free port itself, read back as ``port``)."""

    def __init__(self, host: str, port: int, is_sender: bool, timeout_s: float) -> None:
        self.host, self.timeout_s = host, timeout_s
        self.store = dist.TCPStore(
            host, port, is_master=is_sender, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )  # fmt: skip
        self.port = self.store.port
        self._published: list[str] = []

    def publish(self, version: int, meta: BucketMeta) -> None:
        key = f"{version}/{meta.index}/meta"
        self.store.set(key, meta.to_json())
        self._published.append(key)

    def fetch(self, version: int, index: int) -> BucketMeta:
        """Bucket ``index`` of ``version``'s meta, waiting for the sender to publish it."""
        key = f"{version}/{index}/meta"
        self._wait([key], f"the sender to publish bucket {index} of weight version {version}")
        return BucketMeta.from_json(self.store.get(key))

    def ack(self, version: int, index: int, receiver: int) -> None:
        self.store.set(f"{version}/{index}/ack/{receiver}", "1")

    def wait_acks(self, version: int, index: int, receivers: int) -> None:
        """Until every receiver acknowledged bucket ``index`` (receivers are numbered 1..receivers)."""
        keys = [f"{version}/{index}/ack/{r}" for r in range(1, receivers + 1)]
        self._wait(keys, f"receivers to acknowledge bucket {index} of weight version {version}")
        self._published.extend(keys)

    def forget(self, keep_version: int) -> None:
        """Delete the keys of versions before ``keep_version`` (the store would grow every sync otherwise).

        Only versions every receiver is past may go: see :meth:`WeightSender.send`."""
        stale = [k for k in self._published if int(k.split("/", 1)[0]) < keep_version]
        for key in stale:
            self.store.delete_key(key)
        self._published = [k for k in self._published if k not in set(stale)]

    def _wait(self, keys: list[str], what: str) -> None:
        global _waits_in_progress
        with _waits_lock:
            _waits_in_progress += 1
        try:
            self._wait_slices(keys, what)
        finally:
            with _waits_lock:
                _waits_in_progress -= 1

    def _wait_slices(self, keys: list[str], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if _exiting.is_set():
                raise ConnectionError(f"weight sync: the process is exiting while waiting for {what}")
            try:
                self.store.wait(keys, datetime.timedelta(seconds=min(WAIT_SLICE_S, self.timeout_s)))
                return
            except dist.DistNetworkError as error:
                raise ConnectionError(
                    f"weight sync: lost the control plane at {self.host}:{self.port} while waiting for {what} "
                    f"(did the other side exit?): {error}"
                ) from None
            except dist.DistStoreError:
                if time.monotonic() >= deadline:
                    missing = [k for k in keys if not self.store.check([k])]
                    raise TimeoutError(
                        f"weight sync: waited {self.timeout_s:.0f} s for {what}; missing {missing[:4]}"
                    ) from None
