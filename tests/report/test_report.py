"""The run report built from real runs: every logged metric drawn, the header, comparison,
the live files, no network references, and clear errors for what is not a run."""

import html
import json
import re

import pytest

from tandem.cli import main
from tandem.report import load_run, write_report
from tandem.report.panels import NEVER_DRAWN, STEP_TIME
from tandem.run.trackers import read_jsonl


def figures_of(page: str) -> list[dict]:
    """The plotly figures a report page draws (its ``FIGURES`` constant; the last ``; const REFRESH_S``
    ends it, as a metric name may contain that text too)."""
    start = page.index("const FIGURES = ") + len("const FIGURES = ")
    return json.loads(page[start : page.rindex("; const REFRESH_S")])


def titles_and_traces(page: str) -> dict[str, list[dict]]:
    return {f["layout"]["title"]["text"]: f["data"] for f in figures_of(page)}


def test_every_logged_metric_is_drawn_and_the_issue_s_groups_are_there(report_runs, tmp_path):
    page = write_report([report_runs["fast"]], tmp_path / "report.html").read_text()
    figures = titles_and_traces(page)
    names = {t.get("name", "") for traces in figures.values() for t in traces}
    logged = {k for r in read_jsonl(report_runs["fast"] / "metrics.jsonl") for k in r} - {"step"}
    for metric in sorted(logged - NEVER_DRAWN - {STEP_TIME}):
        base = metric.rsplit("/", 1)[0]
        drawn = {
            metric,
            f"|{metric}|",
            metric.removeprefix("timing_s/"),
            f"{base} (mean)",
            f"{base}/min",
            f"{base}/max",
        }
        assert drawn & names, f"{metric} is not drawn"
    assert "whole step" in names  # timing_s/step: the line over the stacked phases
    for title in (
        "Training score per response (mean, min–max band)",
        "Validation accuracy per data source",
        "Response length in tokens (mean, min–max band)",
        "Responses cut at the length limit (clip ratio)",
        "Entropy",
        "Gradient norm",
        "Learning rate",
        "Seconds per step by phase",
        "Throughput (tokens per second per worker)",
        "Mismatch KL between rollout and trainer log-probs",
        "max |Δ log p| over response tokens",
    ):
        assert title in figures, title
    layouts = {f["layout"]["title"]["text"]: f["layout"] for f in figures_of(page)}
    assert layouts["Mismatch KL between rollout and trainer log-probs"]["yaxis"]["type"] in ("log", "linear")
    assert layouts["Seconds per step by phase"]["yaxis"]["type"] == "linear"  # stacked bars: never log
    phases = {t["name"] for t in figures["Seconds per step by phase"] if t["type"] == "bar"}
    assert {"gen", "reward", "adv", "update_actor", "update_weights"} <= phases
    validation = figures["Validation accuracy per data source"]
    assert [t["x"] for t in validation] == [[0, 2, 4]]  # before training, then every 2 steps


def test_report_is_one_file_with_no_network_references(report_runs, tmp_path):
    page = write_report([report_runs["fast"]], tmp_path / "report.html").read_text()
    assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)\s*=""", page, re.I)
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js inlined
    assert list(tmp_path.iterdir()) == [tmp_path / "report.html"]


def test_header_names_config_model_data_versions_machine_times_and_final_metrics(
    report_runs, rl_files, tmp_path
):
    page = html.unescape(write_report([report_runs["fast"]], tmp_path / "r.html").read_text())
    run = load_run(report_runs["fast"])
    assert run.name == "lr_1e-3" and run.status["status"] == "finished" and run.status["step"] == 4
    for text in (
        rl_files["model"], rl_files["train"], rl_files["val"], "finished at step 4 of 4",
        "torch " + run.info["versions"]["torch"], run.info["machine"]["cpu"], run.info["started_at"],
        run.status["ended_at"], "actor.engine.lr", "val-core/arithmetic/acc/mean@1", "seconds per step (mean)",
    ):  # fmt: skip
        assert text in page, text
    assert "reload every" not in page  # a finished run's page does not reload itself


def test_two_runs_overlaid_with_a_legend_by_experiment_and_their_config_differences(report_runs, tmp_path):
    out = tmp_path / "compare.html"
    assert main(["report", str(report_runs["fast"]), str(report_runs["slow"]), "--out", str(out)]) == 0
    page = out.read_text()
    traces = titles_and_traces(page)["Entropy"]
    assert {t["name"] for t in traces if t.get("showlegend", True)} == {
        "lr_1e-3 · actor/entropy",
        "lr_1e-4 · actor/entropy",
    }
    assert len({t["line"]["color"] for t in traces if t.get("showlegend", True)}) == 2  # a colour per run
    differences = page[page.index("Config differences") : page.index("</section>")]
    assert "actor.engine.lr" in differences and "0.001" in differences and "0.0001" in differences
    assert "trainer.experiment" in differences and "trainer.output_dir" in differences
    assert "data.train_path" not in differences  # the same in both runs
    stacks = [title for title in titles_and_traces(page) if title.startswith("Seconds per step by phase")]
    assert stacks == ["Seconds per step by phase — lr_1e-3", "Seconds per step by phase — lr_1e-4"]


def test_the_report_and_status_file_are_live_during_the_run(report_runs):
    live = report_runs["live"]
    status = json.loads((live / "status.json").read_text())
    assert status["status"] == "running" and status["step"] == 2 and status["total_steps"] == 4
    assert status["eta_s"] is not None and "ended_at" not in status
    page = (live / "report.html").read_text()
    assert "reload every 30 s" in page and "REFRESH_S = 30" in page
    steps = {x for f in figures_of(page) for t in f["data"] for x in t["x"]}
    assert steps == {0, 1, 2}  # what the run had logged by then


def test_a_failed_run_says_so_in_its_status_and_report(rl_files, tmp_path, monkeypatch):
    from tandem.rl import RLTrainer
    from tests.rl.conftest import small_config

    trainer = RLTrainer(small_config(rl_files, tmp_path, "trainer.total_steps=3"))
    original = trainer.train_step

    def fail_at_step_2():
        if trainer.step == 1:
            raise ValueError("reward server unreachable")
        return original()

    trainer.train_step = fail_at_step_2
    with pytest.raises(ValueError, match="unreachable"):
        trainer.fit()
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "failed" and status["step"] == 1
    assert status["error"] == "ValueError: reward server unreachable"
    page = html.unescape((tmp_path / "report.html").read_text())
    assert "failed at step 1 of 3; ValueError: reward server unreachable" in page


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "does not exist"),
        (lambda d: d.mkdir(), "has no metrics.jsonl"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text("")), "has no records yet"),
        (
            lambda d: (d.mkdir(), (d / "metrics.jsonl").write_text('{"step": 1}\n{oops\n')),
            "line 2 is not JSON",
        ),
    ],
    ids=["missing", "not-a-run", "empty", "malformed"],
)
def test_report_on_what_is_not_a_run_is_a_clear_error(tmp_path, capsys, make, message):
    run_dir = tmp_path / "run"
    make(run_dir)
    assert main(["report", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert error.startswith("tandem report: error:") and message in error and str(run_dir) in error
