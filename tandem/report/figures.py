"""Plotly figures (as JSON-ready dicts) for the report's panels, from one or more runs.

One run: a colour per metric. Several runs: a colour per run (the legend names the run) and a
dash per metric, so the same curve of two runs is easy to pair. Lines the page may smooth carry
``meta.smooth`` and a faint raw companion (``meta.raw``) that the smoothing slider shows.
"""

from __future__ import annotations

from tandem.report.panels import LOG_SPAN, STEP_TIME, Panel
from tandem.report.runs import RunData

COLORS = (
    "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
    "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
)  # fmt: skip
DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
FEW_POINTS = 30  # fewer points than this: draw markers too (validation runs every few steps)


def series(run: RunData, metric: str) -> tuple[list[int], list[float | None]]:
    """The steps at which ``run`` logged ``metric`` and the values (None for non-finite ones)."""
    steps, values = [], []
    for record in run.records:
        if metric in record:
            steps.append(record["step"])
            values.append(record[metric])
    return steps, values


def _rgba(color: str, alpha: float) -> str:
    red, green, blue = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({red},{green},{blue},{alpha})"


def _style(run_index: int, metric_index: int, runs: int) -> tuple[str, str]:
    if runs == 1:
        return COLORS[metric_index % len(COLORS)], "solid"
    return COLORS[run_index % len(COLORS)], DASHES[metric_index % len(DASHES)]


def _label(run: RunData, metric: str, runs: int) -> str:
    return metric if runs == 1 else f"{run.name} · {metric}"


def _line_traces(panel: Panel, runs: list[RunData], metrics: list[str]) -> list[dict]:
    traces = []
    for r, run in enumerate(runs):
        for m, metric in enumerate(metrics):
            steps, values = series(run, metric)
            if not steps:
                continue
            if panel.absolute:
                values = [None if v is None else abs(v) for v in values]
                metric = f"|{metric}|"
            color, dash = _style(r, m, len(runs))
            mode = "lines+markers" if len(steps) < FEW_POINTS else "lines"
            if panel.smooth:
                traces.append(_raw_companion(steps, values, color))
            traces.append(
                {
                    "type": "scatter",
                    "mode": mode,
                    "x": steps,
                    "y": values,
                    "name": _label(run, metric, len(runs)),
                    "legendgroup": run.name,
                    "line": {"color": color, "dash": dash, "width": 2},
                    "marker": {"size": 5},
                    "meta": {"smooth": panel.smooth},
                    "hovertemplate": "%{y:.4~g}",
                }  # fmt: skip
            )
    return traces


def _raw_companion(steps: list[int], values: list[float | None], color: str) -> dict:
    return {
        "type": "scatter", "mode": "lines", "x": steps, "y": values, "showlegend": False,
        "hoverinfo": "skip", "visible": False, "line": {"color": _rgba(color, 0.3), "width": 1},
        "meta": {"raw": True},
    }  # fmt: skip


def _band_traces(panel: Panel, runs: list[RunData], bases: list[str]) -> list[dict]:
    traces = []
    for r, run in enumerate(runs):
        for m, base in enumerate(bases):
            color, dash = _style(r, m, len(runs))
            label = _label(run, base, len(runs))
            low, high = series(run, f"{base}/min"), series(run, f"{base}/max")
            if low[0] and high[0]:
                traces.append(
                    {
                        "type": "scatter",
                        "mode": "lines",
                        "x": low[0],
                        "y": low[1],
                        "line": {"width": 0},
                        "name": f"{label}/min",
                        "legendgroup": label,
                        "showlegend": False,
                        "hovertemplate": "min %{y:.4~g}",
                    }  # fmt: skip
                )
                traces.append(
                    {
                        "type": "scatter",
                        "mode": "lines",
                        "x": high[0],
                        "y": high[1],
                        "line": {"width": 0},
                        "fill": "tonexty",
                        "fillcolor": _rgba(color, 0.15),
                        "name": f"{label}/max",
                        "legendgroup": label,
                        "showlegend": False,
                        "hovertemplate": "max %{y:.4~g}",
                    }  # fmt: skip
                )
            steps, values = series(run, f"{base}/mean")
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers" if len(steps) < FEW_POINTS else "lines",
                    "x": steps,
                    "y": values,
                    "name": f"{label} (mean)",
                    "legendgroup": label,
                    "line": {"color": color, "dash": dash, "width": 2},
                    "marker": {"size": 5},
                    "meta": {"smooth": False},
                    "hovertemplate": "mean %{y:.4~g}",
                }  # fmt: skip
            )
    return traces


def _stack_traces(run: RunData, phases: list[str]) -> list[dict]:
    traces = []
    for m, phase in enumerate(phases):
        steps, values = series(run, phase)
        traces.append(
            {
                "type": "bar",
                "x": steps,
                "y": values,
                "name": phase.removeprefix("timing_s/"),
                "marker": {"color": COLORS[m % len(COLORS)]},
                "hovertemplate": "%{y:.3~g} s",
            }  # fmt: skip
        )
    steps, values = series(run, STEP_TIME)
    if steps:
        traces.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": steps,
                "y": values,
                "name": "whole step",
                "line": {"color": "#222", "width": 1.5},
                "hovertemplate": "%{y:.3~g} s",
            }  # fmt: skip
        )
    return traces


def _y_axis(panel: Panel, traces: list[dict]) -> dict:
    values = [v for t in traces for v in t["y"] if v is not None]
    positive = [v for v in values if v > 0]
    if panel.log_y is None:
        log = bool(positive) and min(values) >= 0 and max(positive) / min(positive) >= LOG_SPAN
    else:
        log = panel.log_y and bool(positive)
    axis = {
        "automargin": True,
        "gridcolor": "#e5e5e5",
        "zerolinecolor": "#bbb",
        "type": "log" if log else "linear",
    }
    axis.update({"exponentformat": "power"} if log else {"tickformat": "~g", "exponentformat": "e"})
    return axis


def figure(panel: Panel, runs: list[RunData], metrics: list[str], title: str | None = None) -> dict:
    """The plotly figure ``{"data": [...], "layout": {...}}`` of ``panel`` for ``runs``.

    ``metrics`` are the panel's metrics from :func:`tandem.report.panels.plan` (family bases for
    a band). A ``stack`` panel takes exactly one run (the report draws one per run).
    """
    if panel.kind == "stack":
        assert len(runs) == 1, "a stacked panel shows one run"
        traces = _stack_traces(runs[0], metrics)
    elif panel.kind == "band":
        traces = _band_traces(panel, runs, metrics)
    else:
        traces = _line_traces(panel, runs, metrics)
    y_axis = _y_axis(panel, traces)
    last_step = max((x for t in traces for x in t["x"]), default=0)
    x_axis = {"automargin": True, "gridcolor": "#e5e5e5", "zeroline": False, "tickformat": "~g"}
    if last_step <= 12:
        x_axis["dtick"] = 1  # whole steps only: no "1.5"
    layout = {
        "title": {"text": title or panel.title, "font": {"size": 14}, "x": 0.01, "xanchor": "left"},
        "xaxis": x_axis,
        "yaxis": y_axis,
        "hovermode": "x unified",
        "barmode": "stack",
        "height": 320,
        "margin": {"l": 60, "r": 20, "t": 80, "b": 45},
        "legend": {"orientation": "h", "y": -0.12, "yanchor": "top", "font": {"size": 10}},
        "plot_bgcolor": "white",
        "paper_bgcolor": "white",
        "updatemenus": [_axis_buttons(y_axis["type"])],
    }
    if panel.note:
        layout["annotations"] = [
            {
                "text": panel.note,
                "xref": "paper",
                "yref": "paper",
                "x": 0,
                "y": 1.16,
                "showarrow": False,
                "xanchor": "left",
                "font": {"size": 10, "color": "#666"},
            }  # fmt: skip
        ]
    return {"data": traces, "layout": layout}


def _axis_buttons(current: str) -> dict:
    """Linear / log toggle for the y axis, top right."""
    return {
        "type": "buttons", "direction": "right", "x": 1, "y": 1.2, "xanchor": "right", "yanchor": "top",
        "showactive": True, "active": 1 if current == "log" else 0, "pad": {"r": 0, "t": 0},
        "font": {"size": 10},
        "buttons": [
            {"label": "linear", "method": "relayout", "args": [{"yaxis.type": "linear"}]},
            {"label": "log", "method": "relayout", "args": [{"yaxis.type": "log"}]},
        ],
    }  # fmt: skip
