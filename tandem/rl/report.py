"""The end-of-run report: one self-contained HTML page of SVG line charts drawn from ``metrics.jsonl``.

No plotting library is needed; open ``report.html`` in any browser. Panels: reward, validation
accuracy per data source, response length, the rollout-vs-trainer mismatch and the reference
KL, entropy, and the step time.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from tandem.rl.trackers import read_jsonl

PANELS = (
    ("Training reward", ("critic/score/mean",)),
    ("Validation accuracy", ("val-core/",)),
    ("Response length", ("response_length/mean",)),
    ("KL", ("actor/kl_loss", "rollout_corr/kl", "actor/ppo_kl")),
    ("Entropy", ("actor/entropy",)),
    ("Seconds per step", ("timing_s/step",)),
)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")
WIDTH, HEIGHT, PAD = 460, 240, 44


def _series(records: list[dict], prefixes: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        for key, value in record.items():
            if any(key == p or (p.endswith("/") and key.startswith(p)) for p in prefixes) and isinstance(
                value, (int, float)
            ):
                series.setdefault(key, []).append((float(record["step"]), float(value)))
    return series


def _chart(title: str, series: dict[str, list[tuple[float, float]]]) -> str:
    points = [p for values in series.values() for p in values if math.isfinite(p[1])]
    if not points:
        return ""
    x_low, x_high = min(p[0] for p in points), max(p[0] for p in points)
    y_low, y_high = min(p[1] for p in points), max(p[1] for p in points)
    x_span, y_span = (x_high - x_low) or 1.0, (y_high - y_low) or 1.0

    def place(x: float, y: float) -> str:
        px = PAD + (x - x_low) / x_span * (WIDTH - 1.5 * PAD)
        py = HEIGHT - PAD + -(y - y_low) / y_span * (HEIGHT - 1.6 * PAD)
        return f"{px:.1f},{py:.1f}"

    parts = [
        f'<svg width="{WIDTH}" height="{HEIGHT}" xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="11">',
        f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" font-size="14" font-weight="bold">{html.escape(title)}</text>',
        f'<line x1="{PAD}" y1="{HEIGHT - PAD}" x2="{WIDTH - PAD / 2}" y2="{HEIGHT - PAD}" stroke="#888"/>',
        f'<line x1="{PAD}" y1="{0.6 * PAD}" x2="{PAD}" y2="{HEIGHT - PAD}" stroke="#888"/>',
        f'<text x="{PAD - 4}" y="{HEIGHT - PAD}" text-anchor="end">{y_low:.3g}</text>',
        f'<text x="{PAD - 4}" y="{0.6 * PAD + 8}" text-anchor="end">{y_high:.3g}</text>',
        f'<text x="{PAD}" y="{HEIGHT - PAD + 14}" text-anchor="middle">{x_low:g}</text>',
        f'<text x="{WIDTH - PAD / 2}" y="{HEIGHT - PAD + 14}" text-anchor="end">step {x_high:g}</text>',
    ]
    for index, (name, values) in enumerate(sorted(series.items())):
        color = COLORS[index % len(COLORS)]
        path = " ".join(place(x, y) for x, y in values if math.isfinite(y))
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.8" points="{path}"/>')
        if len(values) == 1:
            parts.append(
                f'<circle cx="{place(*values[0]).split(",")[0]}" cy="{place(*values[0]).split(",")[1]}" r="3" fill="{color}"/>'
            )
        parts.append(
            f'<text x="{PAD + 6}" y="{HEIGHT - 8 - 12 * index}" fill="{color}">{html.escape(name)}</text>'
        )
    parts.append("</svg>")
    return "\n".join(parts)


def write_report(metrics_path: str | Path, target: str | Path, title: str = "tandem RL run") -> Path:
    """Draw the panels from ``metrics_path`` (JSONL) into the HTML file ``target``."""
    records = read_jsonl(metrics_path)
    charts = [_chart(name, _series(records, prefixes)) for name, prefixes in PANELS]
    final = {k: v for k, v in (records[-1] if records else {}).items() if k.startswith("val-core/")}
    summary = "".join(f"<li>{html.escape(k)}: {v:.4g}</li>" for k, v in final.items())
    body = "\n".join(f'<div class="chart">{c}</div>' for c in charts if c)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:24px} .chart{display:inline-block;margin:8px;"
        "border:1px solid #ddd;border-radius:6px}</style></head><body>"
        f"<h1>{html.escape(title)}</h1><p>{len(records)} records from {html.escape(str(metrics_path))}.</p>"
        f"<ul>{summary}</ul>{body}</body></html>"
    )
    target = Path(target)
    target.write_text(page)
    return target
