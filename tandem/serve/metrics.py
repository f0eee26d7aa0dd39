"""``/metrics`` in the Prometheus text format: engine state plus HTTP request counts."""

from __future__ import annotations

import collections
import re
from collections.abc import Sequence

from starlette.routing import compile_path

from tandem.protocol.generation import EngineMetrics

UNMATCHED_ROUTE = "unmatched"  # the one label of every path no route serves (404s)


def escape_label(value: str) -> str:
    """A label value as the Prometheus text format writes it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class HTTPCounters:
    """Requests answered, by route template and status code.

    Labels come from the server's own routes (``/v1/completions``), never from the request
    path, so a client can neither inject text into the page nor grow it: the label set is
    bounded by routes × status codes.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def record(self, route: str, status: int) -> None:
        self.counts[(route, int(status))] += 1


def render_metrics(engine: EngineMetrics, http: HTTPCounters, model: str) -> str:
    """The exposition text (``# HELP``/``# TYPE`` then samples, labelled with the model name)."""
    label = f'model="{escape_label(model)}"'
    gauges = [
        ("tandem_requests_running", "Requests generating now.", engine.running),
        ("tandem_requests_waiting", "Requests queued for admission.", engine.waiting),
        (
            "tandem_generation_tokens_per_second",
            "Generated tokens per second, last 10 s.",
            engine.tokens_per_second,
        ),
        (
            "tandem_kv_cache_usage_ratio",
            "Fraction of the KV-cache token capacity in use.",
            engine.kv_cache_usage,
        ),
        ("tandem_kv_cache_slots_used", "Sequences holding KV-cache slots.", engine.kv_slots_used),
        ("tandem_kv_cache_slots_total", "KV-cache slots (most concurrent sequences).", engine.kv_slots_total),
        ("tandem_weight_version", "Weight version new tokens are sampled under.", engine.version),
        ("tandem_engine_paused", "1 while generation is paused.", int(engine.paused)),
        ("tandem_engine_asleep", "1 while the KV cache is freed.", int(engine.asleep)),
    ]
    counters = [
        ("tandem_generation_tokens_total", "Response tokens generated.", engine.generated_tokens),
        (
            "tandem_prompt_tokens_total",
            "Prompt tokens computed (prefix-cache hits excluded).",
            engine.prompt_tokens,
        ),
    ]
    lines = []
    for name, help_text, value in gauges:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name}{{{label}}} {value}"]
    for name, help_text, value in counters:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name}{{{label}}} {value}"]
    name = "tandem_requests_finished_total"
    lines += [f"# HELP {name} Finished requests by finish reason.", f"# TYPE {name} counter"]
    lines += [f'{name}{{{label},reason="{escape_label(r)}"}} {n}' for r, n in sorted(engine.finished.items())]
    name = "tandem_http_requests_total"
    lines += [f"# HELP {name} HTTP requests answered by route and status.", f"# TYPE {name} counter"]
    lines += [
        f'{name}{{route="{escape_label(route)}",status="{status}"}} {n}'
        for (route, status), n in sorted(http.counts.items())
    ]
    return "\n".join(lines) + "\n"


class RouteCounter:
    """An ASGI wrapper counting every HTTP response in ``counters`` by route template and status.

    ``route_templates`` lists the served paths (``/v1/completions``; ``{param}`` segments
    allowed); it is read at the first request, so it may be filled after the app is wrapped. A request
    matching none counts as :data:`UNMATCHED_ROUTE`; a response never started (the app
    raised) counts as 500.
    """

    def __init__(self, app, counters: HTTPCounters, route_templates: Sequence[str]) -> None:
        self.app = app
        self.counters = counters
        self.route_templates = route_templates
        self.patterns: list[tuple[re.Pattern, str]] | None = None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def recording_send(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            self.counters.record(self.route_of(scope["path"]), status)

    def route_of(self, path: str) -> str:
        if self.patterns is None:
            self.patterns = [(compile_path(t)[0], t) for t in self.route_templates]
        return next((template for pattern, template in self.patterns if pattern.match(path)), UNMATCHED_ROUTE)
