"""Open a page in headless Chromium and report what a user would see: console errors, uncaught
exceptions, failed loads, and a full-page screenshot.

Talks the DevTools protocol over a pipe (``--remote-debugging-pipe``: we write commands to the
browser's fd 3 and read its answers from fd 4, each a JSON object ending in a NUL byte), so no
driver package is needed, only a Chromium binary (Debian's ``chromium`` package works). Used by
the report's page check in the tests and by ``tandem report --screenshot``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> str | None:
    """The path of a Chromium-family browser on ``PATH`` (or ``$TANDEM_BROWSER``), or None."""
    if os.environ.get("TANDEM_BROWSER"):
        return os.environ["TANDEM_BROWSER"]
    for name in BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class PageCheck:
    """What loading a page showed: error messages (console, exceptions, failed loads), the URLs
    it requested, whether ``ready_expression`` became true, the values of the ``probes``, and the
    screenshot's PNG bytes."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    ready: bool = False
    values: list[object] = field(default_factory=list)
    screenshot: bytes = b""


class _DevTools:
    """A minimal DevTools-protocol client over the browser's pipe (one page session)."""

    def __init__(self, browser: str, profile_dir: str) -> None:
        read_commands, self._commands = os.pipe()  # browser reads fd 3
        self._answers, write_answers = os.pipe()  # browser writes fd 4
        self.process = subprocess.Popen(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--remote-debugging-pipe",
                f"--user-data-dir={profile_dir}",
                "about:blank",
            ],
            pass_fds=(read_commands, write_answers, 3, 4),  # 3 and 4 stay open after _place_pipe_ends
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=lambda: _place_pipe_ends(read_commands, write_answers),
            start_new_session=True,  # its helper processes share a group that close() ends together
        )
        os.close(read_commands)
        os.close(write_answers)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    def send(self, method: str, params: dict | None = None, timeout: float = 30.0) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session is not None:
            message["sessionId"] = self.session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            try:
                self.events.append(self._read(deadline))
            except TimeoutError:
                return False
        return True

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self._answers, 1 << 20)
            if not chunk:
                raise RuntimeError("the browser exited")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        for fd in (self._commands, self._answers):
            os.close(fd)
        with contextlib.suppress(ProcessLookupError):  # the browser and every helper it started
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def _place_pipe_ends(commands: int, answers: int) -> None:
    """In the browser's process: its command pipe on fd 3, its answer pipe on fd 4."""
    commands, answers = os.dup(commands), os.dup(answers)  # above 4, so placing one cannot clobber the other
    os.dup2(commands, 3)
    os.dup2(answers, 4)


def check_page(
    page: str | Path,
    ready_expression: str = "true",
    probes: tuple[str, ...] = (),
    width: int = 1400,
    height: int = 0,
    timeout: float = 60.0,
    browser: str | None = None,
) -> PageCheck:
    """Load ``page`` (a file path) in headless Chromium, wait for the load event and for
    ``ready_expression`` (JavaScript) to be true, evaluate each of ``probes`` in turn (JavaScript
    expressions; their JSON values are returned, promises awaited), and return the errors seen
    and a screenshot: the whole page, or its top ``height`` pixels when ``height`` is set. Raises ``FileNotFoundError`` when no browser is installed."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError(
            "no Chromium-family browser found (install Debian's 'chromium' package or set TANDEM_BROWSER)"
        )
    result = PageCheck()
    # A helper process may still be writing the profile as it dies: cleaning it up is best effort.
    with tempfile.TemporaryDirectory(prefix="tandem-browser-", ignore_cleanup_errors=True) as profile:
        tools = _DevTools(browser, profile)
        try:
            _open_page(tools, Path(page), width, height, timeout)
            result.ready = _wait_until_true(tools, ready_expression, timeout)
            result.values = [_evaluate(tools, probe) for probe in probes]
            shot = tools.send(
                "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": not height}
            )
            result.screenshot = base64.b64decode(shot["data"])
            result.errors = _errors(tools.events)
            result.requests = [
                e["params"]["request"]["url"]
                for e in tools.events
                if e.get("method") == "Network.requestWillBeSent"
            ]
        finally:
            tools.close()
    return result


def _open_page(tools: _DevTools, page: Path, width: int, height: int, timeout: float) -> None:
    """Attach to the browser's page, enable the domains whose events are collected, size the
    viewport, then load ``page`` and wait for its load event (the events before it are dropped)."""
    targets = tools.send("Target.getTargets")["targetInfos"]
    page_target = next(t["targetId"] for t in targets if t["type"] == "page")
    tools.session = tools.send("Target.attachToTarget", {"targetId": page_target, "flatten": True})[
        "sessionId"
    ]
    for domain in ("Runtime", "Log", "Page", "Network"):
        tools.send(f"{domain}.enable")
    tools.send(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height or 900, "deviceScaleFactor": 1, "mobile": False},
    )
    tools.events.clear()
    tools.send("Page.navigate", {"url": page.resolve().as_uri()})
    tools.wait_event("Page.loadEventFired", timeout)


def _wait_until_true(tools: _DevTools, expression: str, timeout: float) -> bool:
    """Whether the JavaScript ``expression`` became true within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = tools.send("Runtime.evaluate", {"expression": f"Boolean({expression})"})
        if value.get("result", {}).get("value") is True:
            return True
        time.sleep(0.1)
    return False


def _evaluate(tools: _DevTools, probe: str) -> object:
    """The JSON value of the JavaScript expression ``probe`` (a promise awaited); ``RuntimeError``
    when it throws."""
    answer = tools.send(
        "Runtime.evaluate", {"expression": probe, "returnByValue": True, "awaitPromise": True}
    )
    if "exceptionDetails" in answer:
        raise RuntimeError(f"probe {probe!r} failed: {answer['exceptionDetails'].get('text')}")
    return answer.get("result", {}).get("value")


def _errors(events: list[dict]) -> list[str]:
    errors = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            errors.append(
                f"exception: {details.get('exception', {}).get('description') or details.get('text')}"
            )
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            errors.append(
                "console.error: "
                + " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            )
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            errors.append(f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip())
    return errors
