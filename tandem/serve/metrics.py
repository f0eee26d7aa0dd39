"""``/metrics`` in the Prometheus text format: engine state plus HTTP request counts."""

from __future__ import annotations

import collections

from tandem.rollout.types import EngineMetrics


class HTTPCounters:
    """Requests answered, by route and status code."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def record(self, route: str, status: int) -> None:
        self.counts[(route, status)] += 1


def render_metrics(engine: EngineMetrics, http: HTTPCounters, model: str) -> str:
    """The exposition text (``# HELP``/``# TYPE`` then samples, labelled with the model name)."""
    label = f'model="{model}"'
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
    lines += [f'{name}{{{label},reason="{r}"}} {n}' for r, n in sorted(engine.finished.items())]
    name = "tandem_http_requests_total"
    lines += [f"# HELP {name} HTTP requests answered by route and status.", f"# TYPE {name} counter"]
    lines += [
        f'{name}{{route="{route}",status="{status}"}} {n}'
        for (route, status), n in sorted(http.counts.items())
    ]
    return "\n".join(lines) + "\n"
