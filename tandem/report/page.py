"""The report page: one self-contained HTML file (plotly.js inlined, no network access) with a
header per run, the config differences between compared runs, and the charts by section.

Controls on the page: a smoothing slider (an exponential moving average with TensorBoard's bias
correction, raw values shown faintly behind), a linear/log toggle per chart, hover values at a
step across every curve of a chart, and, while a run is still going, a reload every
:data:`REFRESH_S` seconds (a checkbox turns it off).
"""

from __future__ import annotations

import html
import json
from functools import lru_cache

from tandem.report.figures import figure
from tandem.report.panels import plan
from tandem.report.runs import RunData
from tandem.report.samples import read_val_samples, samples_html

REFRESH_S = 30
FINAL_KEYS = (
    "critic/score/mean", "response_length/mean", "actor/entropy", "rollout_corr/kl",
    "loss", "rewards/accuracies", "eval_loss", "eval_rewards/accuracies", "eval_rewards/margins",
)  # fmt: skip


@lru_cache(maxsize=1)
def plotly_js() -> str:
    """The plotly.js bundle shipped inside the ``plotly`` Python package."""
    from plotly.offline import get_plotlyjs

    return get_plotlyjs()


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    if not isinstance(value, dict):
        return {prefix: value}
    flat: dict[str, object] = {}
    for key, inner in value.items():
        flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _table(rows: list[tuple[str, ...]], header: tuple[str, ...] = ()) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{f'<tr>{head}</tr>' if head else ''}{body}</table>"


def _number(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def final_metrics(run: RunData) -> list[tuple[str, str]]:
    """The last value of each validation metric and of the key training metrics, and step times."""
    last: dict[str, object] = {}
    for record in run.records:
        last.update({k: v for k, v in record.items() if v is not None})
    rows = [(k, _number(v)) for k, v in sorted(last.items()) if k.startswith("val-core/")]
    rows += [(k, _number(last[k])) for k in FINAL_KEYS if k in last]
    times = [r["timing_s/step"] for r in run.records if r.get("timing_s/step") is not None]
    if times:
        rows.append(("seconds per step (mean)", f"{sum(times) / len(times):.3g}"))
    rows.append(("steps logged", f"{len(run.records)} (last: step {run.records[-1]['step']})"))
    return rows


def _status_line(run: RunData) -> str:
    status = run.status
    if not status:
        return "status unknown (no status.json)"
    text = f"{status.get('status', '?')} at step {status.get('step')} of {status.get('total_steps')}"
    if status.get("status") == "running":
        text += f"; last update {status.get('updated_at')}"
        if status.get("eta_s") is not None:
            text += f"; about {status['eta_s'] / 60:.1f} min left"
    if status.get("error"):
        text += f"; {status['error']}"
    return text


def _run_header(run: RunData) -> str:
    info, status = run.info, run.status
    machine = info.get("machine", {})
    machine_text = (
        f"{machine.get('cpu')}, {machine.get('cores')} cores, CPU flags {' '.join(machine.get('cpu_flags') or []) or 'none'}, "
        f"{machine.get('memory_gib')} GiB, GPUs: {', '.join(machine.get('gpus') or []) or 'none'} ({machine.get('host')})"
        if machine
        else "unknown (no run.json)"
    )
    facts = [
        ("status", _status_line(run)),
        ("directory", str(run.directory)),
        ("trainer", info.get("trainer", "?")),
        ("command line", info.get("command_line", "?")),
        ("model", info.get("model_path", "?")),
        *((f"data ({role})", path) for role, path in info.get("data_files", {}).items()),
        ("started", status.get("started_at") or info.get("started_at", "?")),
        ("ended", status.get("ended_at", "—")),
        ("machine", machine_text),
        ("versions", ", ".join(f"{k} {v}" for k, v in info.get("versions", {}).items()) or "?"),
    ]
    if info.get("resumed_at"):
        facts.append(("resumed", ", ".join(f"step {r['step']} at {r['time']}" for r in info["resumed_at"])))
    if info.get("interrupted"):
        stops = (
            f"at step {i['step']} (process {i['pid']} gone; last update {i['last_update']})"
            for i in info["interrupted"]
        )
        facts.append(("interrupted", ", ".join(stops)))
    config = flatten(info.get("config", {}))
    samples = samples_html(read_val_samples(run.directory))
    return (
        f"<section class='run'><h2>{html.escape(run.name)}</h2>{_table(facts)}"
        f"<h3>Final metrics</h3>{_table(final_metrics(run))}"
        + (f"<h3>Validation samples</h3>{samples}" if samples else "")
        + f"<details><summary>Resolved config ({len(config)} keys)</summary>"
        f"{_table([(k, json.dumps(v)) for k, v in sorted(config.items())])}</details></section>"
    )


def config_differences(runs: list[RunData]) -> list[tuple[str, ...]]:
    """``(key, value in run 1, value in run 2, ...)`` for every config key whose values differ."""
    flats = [flatten(run.info.get("config", {})) for run in runs]
    keys = sorted(set().union(*flats))
    missing = "(absent)"
    return [
        (key, *(json.dumps(f[key]) if key in f else missing for f in flats))
        for key in keys
        if len({json.dumps(f.get(key, missing)) for f in flats}) > 1
    ]


def _figures(runs: list[RunData]) -> list[tuple[str, list[dict]]]:
    names = set().union(*(run.metric_names() for run in runs))
    sections = []
    for title, panels in plan(names):
        figures = []
        for panel, metrics in panels:
            if panel.kind == "stack":
                for run in runs:
                    own = [m for m in metrics if m in run.metric_names()]
                    if own:
                        label = panel.title if len(runs) == 1 else f"{panel.title} — {run.name}"
                        figures.append(figure(panel, [run], own, label))
            else:
                figures.append(figure(panel, runs, metrics))
        sections.append((title, figures))
    return sections


def script_json(value: object) -> str:
    """``value`` as JSON safe to embed in a ``<script>`` element: every ``<`` written as ``\\u003c``.

    Escaping only ``</`` is not enough: a ``<!--`` followed by ``<script>`` in a metric, data
    source or experiment name switches the HTML parser into the script's "double escaped" state,
    where the closing ``</script>`` no longer ends it and every chart stays blank. With no ``<``
    left, the parser cannot leave the script early; JavaScript reads ``\\u003c`` as ``<``.
    """
    return json.dumps(value, allow_nan=False).replace("<", "\\u003c")


def render(runs: list[RunData], title: str | None = None) -> str:
    """The whole report page for ``runs`` as an HTML string."""
    title = title or (
        runs[0].name if len(runs) == 1 else f"Comparing {len(runs)} runs: " + ", ".join(r.name for r in runs)
    )
    live = any(run.status.get("status") == "running" for run in runs)
    parts = [f"<h1>{html.escape(title)}</h1>"]
    if len(runs) > 1:
        differences = config_differences(runs)
        parts.append(
            "<section class='run'><h2>Config differences</h2>"
            + (_table(differences, ("key", *(r.name for r in runs))) if differences else "<p>none</p>")
            + "</section>"
        )
    parts.extend(_run_header(run) for run in runs)
    controls = (
        "<div id='controls'><label>smoothing <input id='smoothing' type='range' min='0' max='0.99' "
        "step='0.01' value='0'> <span id='smoothing-value'>0</span></label>"
        " <span class='hint'>x axis: training step; hover a chart for every value at a step</span>"
    )
    if live:
        controls += f" <label><input id='refresh' type='checkbox' checked> reload every {REFRESH_S} s (run in progress)</label>"
    parts.append(controls + "</div>")
    figures = []
    for section, section_figures in _figures(runs):
        parts.append(f"<h2 class='section'>{html.escape(section)}</h2><div class='grid'>")
        for fig in section_figures:
            parts.append(f"<div class='chart' id='chart-{len(figures)}'></div>")
            figures.append(fig)
        parts.append("</div>")
    data = script_json(figures)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{CSS}</style>"
        f"<script>{plotly_js()}</script></head><body>{''.join(parts)}"
        f"<script>const FIGURES = {data}; const REFRESH_S = {REFRESH_S if live else 0};\n{SCRIPT}</script>"
        "</body></html>"
    )


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:20px 28px;color:#222}
h1{font-size:22px;margin:0 0 12px} h2{font-size:17px;margin:14px 0 6px} h3{font-size:14px;margin:10px 0 4px}
h2.section{border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:26px}
section.run{border:1px solid #ddd;border-radius:6px;padding:8px 14px;margin:10px 0;background:#fafafa}
table{border-collapse:collapse;font-size:12px} td,th{padding:2px 10px 2px 0;text-align:left;vertical-align:top}
th{border-bottom:1px solid #ccc} td:first-child{color:#555;white-space:nowrap}
details{margin:6px 0} summary{cursor:pointer;font-size:13px}
#controls{position:sticky;top:0;background:#fff;padding:8px 0;z-index:10;border-bottom:1px solid #eee;font-size:13px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(560px,1fr));gap:10px}
.hint{color:#777;margin-left:18px}
.chart{border:1px solid #e3e3e3;border-radius:6px;min-height:320px}
table.samples td{vertical-align:top;max-width:520px}
table.samples pre{white-space:pre-wrap;margin:2px 0;font-size:12px}
img.thumb{max-width:160px;max-height:160px;margin:2px;border:1px solid #ccc;image-rendering:pixelated}
"""

SCRIPT = """
function smoothed(values, weight) {  // EMA with bias correction; gaps (null) stay gaps
  let last = 0, count = 0;
  return values.map(v => {
    if (v === null) return null;
    count += 1; last = last * weight + (1 - weight) * v;
    return weight > 0 ? last / (1 - Math.pow(weight, count)) : v;
  });
}
const raw = new Map();
const drawn = FIGURES.map((fig, i) => {
  const id = 'chart-' + i;
  fig.data.forEach((trace, t) => { if (trace.meta && trace.meta.smooth) raw.set(id + ':' + t, trace.y.slice()); });
  return Plotly.newPlot(id, fig.data, fig.layout, {responsive: true, displaylogo: false});
});
Promise.all(drawn).then(() => { window.tandemReportReady = true; });
const slider = document.getElementById('smoothing');
slider.addEventListener('input', () => {
  const weight = Number(slider.value);
  document.getElementById('smoothing-value').textContent = weight.toFixed(2);
  FIGURES.forEach((fig, i) => {
    const id = 'chart-' + i, ys = [], visible = [], indices = [];
    fig.data.forEach((trace, t) => {
      if (trace.meta && trace.meta.smooth) { indices.push(t); ys.push(smoothed(raw.get(id + ':' + t), weight)); visible.push(true); }
      else if (trace.meta && trace.meta.raw) { indices.push(t); ys.push(trace.y); visible.push(weight > 0); }
    });
    if (indices.length) Plotly.restyle(id, {y: ys, visible: visible}, indices);
  });
});
if (REFRESH_S > 0) {
  setInterval(() => { if (document.getElementById('refresh').checked) location.reload(); }, REFRESH_S * 1000);
}
"""
