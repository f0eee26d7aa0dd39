"""The admin routes (``/admin/*``): pause, resume, update weights from a directory, weight
version, sleep, wake, reset the prefix cache."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request

from tandem.models.weights import read_hf_weights
from tandem.serve.errors import APIError
from tandem.serve.schemas import PauseRequest, UpdateWeightsRequest


def admin_router(engine, authorize: Callable[[Request], None]) -> APIRouter:
    """The ``/admin`` routes over ``engine``; one weight update at a time."""
    admin = APIRouter(prefix="/admin", dependencies=[Depends(authorize)])
    weights_lock = asyncio.Lock()

    @admin.post("/pause")
    async def pause(body: PauseRequest):
        await asyncio.to_thread(engine.pause, body.mode)
        return {"paused": True, "mode": body.mode}

    @admin.post("/resume")
    async def resume():
        await asyncio.to_thread(engine.resume)
        return {"paused": False}

    @admin.get("/weight_version")
    async def weight_version():
        return {"version": engine.version}

    @admin.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest):
        """Read the directory's tensors, then pause (keep), load, resume: requests continue."""
        async with weights_lock:
            return await _update_weights(engine, body)

    @admin.post("/sleep")
    async def sleep():
        try:
            await asyncio.to_thread(engine.sleep)
        except RuntimeError as error:
            raise APIError(409, str(error)) from error
        return {"asleep": True}

    @admin.post("/wake")
    async def wake():
        await asyncio.to_thread(engine.wake)
        return {"asleep": False}

    @admin.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        await asyncio.to_thread(engine.reset_prefix_cache)
        return {"reset": True}

    return admin


async def _update_weights(engine, body: UpdateWeightsRequest) -> dict:
    """Load the weights in ``body.path`` as ``body.version`` (default: the next one): read them
    first, then pause the engine (keeping its requests), load, and resume. The caller holds the
    one-update-at-a-time lock. ``APIError`` 409 for a version that does not increase, 400 for
    weights that cannot be read or do not fit the model."""
    version = engine.version + 1 if body.version is None else body.version
    if version <= engine.version:
        raise APIError(409, f"version must increase: got {version}, current {engine.version}", "version")
    try:
        tensors = await asyncio.to_thread(lambda: list(read_hf_weights(body.path)))
    except FileNotFoundError as error:
        raise APIError(400, str(error), "path") from error
    except Exception as error:  # a corrupt or foreign file is the caller's problem, not the server's
        raise APIError(
            400, f"could not read weights from {body.path}: {type(error).__name__}: {error}", "path"
        ) from error
    was_paused = (await asyncio.to_thread(engine.metrics)).paused
    if not was_paused:
        await asyncio.to_thread(engine.pause, "keep")
    try:
        loaded = await asyncio.to_thread(engine.update_weights, tensors, version)
    except (KeyError, ValueError) as error:
        raise APIError(400, f"these weights do not fit the served model: {error}", "path") from error
    finally:
        if not was_paused:
            await asyncio.to_thread(engine.resume)
    return {"version": version, "tensors": loaded}
