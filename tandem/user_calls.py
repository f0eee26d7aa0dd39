"""Running user code (reward functions, tools, interaction functions) on daemon threads, under deadlines.

Python cannot stop a thread, and ``concurrent.futures``' pools join their threads at exit, so a
user's function that never returns would hold a pool's worker, the step waiting for it, or the
interpreter's exit. Here every call runs on a daemon thread of its own: a call past its deadline
is abandoned (it ends by itself, or with the process), and nothing waits for it. Whatever the
function raises (``SystemExit`` and ``KeyboardInterrupt`` too: user code must not end the run)
fails its future as a :class:`UserCodeError`, which keeps the original in ``raised``.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future


class UserCodeError(Exception):
    """A user's function raised (anything, ``SystemExit`` included) or ran past its time limit;
    the message says which, in words the model or the log can show. ``raised`` is what the
    function raised (None for a call past its deadline)."""

    def __init__(self, message: str, raised: BaseException | None = None) -> None:
        super().__init__(message)
        self.raised = raised


def describe_error(error: BaseException, limit: int = 2000) -> str:
    """``Type: message``, the message cut to ``limit`` characters, even for an exception whose
    ``str()`` itself raises (user code may raise anything)."""
    try:
        message = str(error)
    except Exception:
        message = "<the exception's message cannot be shown>"
    if len(message) > limit:
        message = f"{message[:limit]} [... {len(message) - limit} characters cut]"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def start_user_call(function: Callable[..., object], /, *args: object, **kwargs: object) -> Future:
    """Start ``function(*args, **kwargs)`` on a daemon thread of its own; a ``Future`` of its
    result, failing with :class:`UserCodeError` whatever it raised. A future cancelled before
    its thread started never runs the function.

    A thread per call, not a pool's: a call that never returns then holds no worker others wait
    for, and, being a daemon, does not keep the process alive at exit. (``function`` is
    positional-only, so a tool may have an argument of that name.)
    """
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():  # cancelled (timed out) before it started
            return
        try:
            future.set_result(function(*args, **kwargs))
        except BaseException as error:  # SystemExit and KeyboardInterrupt too: user code must not end the run
            future.set_exception(UserCodeError(describe_error(error), raised=error))

    threading.Thread(target=run, name="tandem-user-code", daemon=True).start()
    return future


def wait_user_call(future: Future, timeout_s: float, what: str) -> object:
    """The result of :func:`start_user_call`'s ``future``; :class:`UserCodeError` when it failed
    or did not return within ``timeout_s`` seconds (``what`` names the call in that message)."""
    try:
        return future.result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise UserCodeError(f"{what} did not return within {timeout_s:g} s") from None
