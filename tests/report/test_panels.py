"""Which panels draw which metrics, and the y-axis choice, on hand-made runs."""

from pathlib import Path

from tandem.report.figures import figure
from tandem.report.panels import Panel, plan
from tandem.report.runs import RunData


def run_of(records, name="run"):
    return RunData(name, Path("."), records, {}, {})


def drawn(names):
    return {panel.title: metrics for _, panels in plan(set(names)) for panel, metrics in panels}


def test_each_metric_goes_to_exactly_one_panel_and_unknown_ones_to_other_metrics():
    names = {
        "rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/is_ess", "critic/score/mean",
        "critic/score/min", "critic/score/max", "my_reward/part/a", "my_reward/part/b", "loose",
        "training/epoch", "timing_s/step", "timing_s/gen",
    }  # fmt: skip
    panels = drawn(names)
    assert panels["Mismatch KL between rollout and trainer log-probs"] == [
        "rollout_corr/k3_kl",
        "rollout_corr/kl",
    ]
    assert panels["Importance weights and masking"] == ["rollout_corr/is_ess"]  # kl taken by the panel above
    assert panels["Training score per response (mean, min–max band)"] == ["critic/score"]
    assert panels["Seconds per step by phase"] == ["timing_s/gen"]
    assert panels["my_reward/part"] == ["my_reward/part/a", "my_reward/part/b"] and panels["loose"] == [
        "loose"
    ]
    every = [m for metrics in panels.values() for m in metrics]
    assert len(every) == len(set(every))
    assert "training/epoch" not in every and "timing_s/step" not in every


def test_log_axis_when_positive_values_span_decades_and_never_below_zero():
    spans = run_of([{"step": s, "a": v} for s, v in enumerate([1e-9, 1e-6, 1e-3])])
    narrow = run_of([{"step": s, "a": v} for s, v in enumerate([0.5, 0.6, 0.7])])
    signed = run_of([{"step": s, "a": v} for s, v in enumerate([-1e-9, 1e-6, 1e-3])])
    auto = Panel("a", ("a",))
    assert figure(auto, [spans], ["a"])["layout"]["yaxis"]["type"] == "log"
    assert figure(auto, [narrow], ["a"])["layout"]["yaxis"]["type"] == "linear"
    assert figure(auto, [signed], ["a"])["layout"]["yaxis"]["type"] == "linear"
    absolute = Panel("a", ("a",), log_y=True, absolute=True)
    fig = figure(absolute, [signed], ["a"])
    assert fig["layout"]["yaxis"]["type"] == "log" and fig["data"][-1]["y"] == [1e-9, 1e-6, 1e-3]
    zeros = run_of([{"step": s, "a": 0.0} for s in range(3)])  # bit-identical: nothing to draw on a log axis
    assert figure(absolute, [zeros], ["a"])["layout"]["yaxis"]["type"] == "linear"


def test_gaps_stay_gaps_and_runs_get_a_colour_each():
    records = [{"step": 1, "a": 1.0}, {"step": 2, "a": None}, {"step": 3, "a": 3.0}]
    panel = Panel("a", ("a",), smooth=False)
    fig = figure(panel, [run_of(records, "x"), run_of(records, "y")], ["a"])
    assert [t["y"] for t in fig["data"]] == [[1.0, None, 3.0]] * 2
    assert [t["name"] for t in fig["data"]] == ["x · a", "y · a"]
    assert fig["data"][0]["line"]["color"] != fig["data"][1]["line"]["color"]
