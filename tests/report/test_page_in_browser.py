"""The report opened in a real headless Chromium: it draws every chart without console errors
or network requests (names that try to end its script included), the smoothing slider matches a
Python reference, and the screenshot is saved (``test-artifacts/`` or ``$TANDEM_TEST_ARTIFACTS``).

Needs a Chromium binary (Debian's ``chromium`` package; CI installs it). Skipped without one,
except under CI, where a missing browser fails the test."""

import os
from pathlib import Path

import pytest

from tandem.report import write_report
from tandem.report.browser import check_page, find_browser
from tests.report.test_hostile_runs import HOSTILE_NAMES, write_run
from tests.report.test_report import figures_of

ARTIFACTS = Path(os.environ.get("TANDEM_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts"))
READY = "window.tandemReportReady === true"


@pytest.fixture(scope="module")
def browser():
    path = find_browser()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Chromium for the report's page check (see .ci/run)")
        pytest.skip("no Chromium-family browser installed (apt-get install chromium)")
    return path


def ema(values, weight):
    """TensorBoard's debiased exponential moving average: the reference for the page's slider."""
    out, last = [], 0.0
    for count, value in enumerate(values, start=1):
        last = last * weight + (1 - weight) * value
        out.append(last / (1 - weight**count))
    return out


def test_report_loads_in_chromium_without_errors_and_is_screenshotted(report_runs, tmp_path, browser):
    page = write_report([report_runs["fast"], report_runs["slow"]], tmp_path / "compare.html")
    figures = figures_of(page.read_text())
    smooth_chart = next(i for i, f in enumerate(figures) if f["layout"]["title"]["text"] == "Entropy")
    smooth_trace = next(
        t for t, trace in enumerate(figures[smooth_chart]["data"]) if trace.get("meta", {}).get("smooth")
    )
    slide = (
        "(() => { const s = document.getElementById('smoothing'); s.value = '0.6';"
        " s.dispatchEvent(new Event('input')); return true; })()"
    )
    check = check_page(
        page,
        READY,
        probes=(
            "document.querySelectorAll('.js-plotly-plot').length",
            "Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => d.layout.yaxis.type)",
            slide,
            f"document.getElementById('chart-{smooth_chart}').data[{smooth_trace}].y",
            f"document.getElementById('chart-{smooth_chart}').data[{smooth_trace - 1}].visible",
        ),
        browser=browser,
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "report-compare.png").write_bytes(check.screenshot)
    assert check.ready, "the charts never finished drawing"
    assert check.errors == []
    assert {url.split(":", 1)[0] for url in check.requests} == {"file"}  # nothing fetched from a network
    drawn, axis_types, _, smoothed, raw_visible = check.values
    assert drawn == len(figures)
    assert axis_types == [f["layout"]["yaxis"]["type"] for f in figures]
    raw = figures[smooth_chart]["data"][smooth_trace]["y"]
    assert smoothed == pytest.approx(ema(raw, 0.6), rel=1e-9)
    assert raw_visible is True  # the raw values show faintly behind the smoothed line
    assert check.screenshot[:8] == b"\x89PNG\r\n\x1a\n" and len(check.screenshot) > 50_000


def test_report_screenshot_from_the_command_line(report_runs, tmp_path, browser, capsys):
    from tandem.cli import main

    shot = tmp_path / "shot.png"
    assert (
        main(
            ["report", str(report_runs["fast"]), "--out", str(tmp_path / "r.html"), "--screenshot", str(shot)]
        )
        == 0
    )
    assert shot.read_bytes()[:4] == b"\x89PNG" and "page error" not in capsys.readouterr().out


def test_hostile_names_neither_blank_the_charts_nor_run_as_script(tmp_path, browser):
    runs = [
        write_run(tmp_path / "a", "<!--<script>", HOSTILE_NAMES),
        write_run(tmp_path / "b", "</script><!--", HOSTILE_NAMES[::-1]),
    ]
    page = write_report(runs, tmp_path / "hostile.html")
    figures = figures_of(page.read_text())
    check = check_page(
        page,
        READY,
        probes=(
            "Array.from(document.querySelectorAll('.js-plotly-plot')).map(d => d.data.map(t => t.name || ''))",
            "typeof window.pwned",
        ),
        browser=browser,
        timeout=30,
    )
    (ARTIFACTS / "report-hostile.png").parent.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "report-hostile.png").write_bytes(check.screenshot)
    assert check.ready, "the charts never finished drawing"
    assert check.errors == []
    drawn_names, pwned = check.values
    assert drawn_names == [[t.get("name", "") for t in f["data"]] for f in figures]  # every chart, as given
    assert any(name.startswith("<!--<script> · ") for names in drawn_names for name in names)
    assert pwned == "undefined"  # no name ran as script
