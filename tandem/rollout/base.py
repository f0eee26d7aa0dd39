"""The ``RolloutEngine`` protocol every generation backend implements."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from typing import ClassVar, Protocol

import torch

from tandem.protocol.generation import Completion, EngineMetrics, RolloutRequest, TokenCallback


class RolloutEngine(Protocol):
    """Asynchronous, per-request generation with versioned weight updates.

    ``submit`` queues a request and returns a future of its :class:`Completion` (``generate``
    is the asyncio form); its ``on_token`` callback sees every token as it is sampled
    (streaming); ``abort`` finishes one early; ``pause(mode)``/``resume`` bracket a
    weight update (``keep`` in-flight requests, ``abort`` them, or ``wait`` for them);
    ``update_weights`` loads ``(name, tensor)`` pairs and sets the version later tokens
    carry (asleep, too: the cache stays freed until ``wake``); ``sleep``/``wake`` free and
    restore cache memory; ``reset_prefix_cache`` drops
    reusable prompt state; ``metrics`` is a monitoring snapshot.

    ``generates_in_background`` says whether requests run on the engine's own thread: ``submit``
    returns at once, ``on_token`` sees each token as it is sampled and ``abort`` stops a request
    midway. A server needs that (``tandem serve`` offers only such engines); an engine that
    generates inside ``submit`` would hold the server's event loop for a whole response.
    """

    generates_in_background: ClassVar[bool]
    version: int
    max_model_len: int  # longest prompt + response
    vocab_size: int

    def submit(self, request: RolloutRequest, *, on_token: TokenCallback | None = None) -> Future: ...

    async def generate(self, request: RolloutRequest) -> Completion: ...

    def generate_batch(
        self, requests: Iterable[RolloutRequest], timeout: float | None = None
    ) -> list[Completion]: ...

    def abort(self, request_id: str) -> bool: ...

    def pause(self, mode: str = "keep") -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def metrics(self) -> EngineMetrics: ...

    def close(self) -> None: ...
