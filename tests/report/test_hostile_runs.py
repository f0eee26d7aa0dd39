"""The report on run directories a careless or hostile user could leave: names that would end
the page's script early, ``metrics.jsonl`` steps that are not steps, and a trainer killed with
SIGKILL whose ``status.json`` still says ``running``."""

import base64
import html
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from PIL import Image

from tandem.cli import main
from tandem.report import load_run, write_report
from tandem.report.run_info import RUN_FILE, STATUS_FILE, RunInfo
from tandem.report.samples import VAL_SAMPLES_FILE, append_val_samples, thumbnail_url
from tests.report.test_report import figures_of

# each would end the page's script, open a comment or start a new script if embedded as it is
HOSTILE_NAMES = (
    "<!--<script>",
    "</script><script>window.pwned = 1</script>",
    "<!-- x --><script>",
    "]; const REFRESH_S = 1; //",
)


def write_run(directory: Path, experiment: str, names: tuple[str, ...], steps: int = 3) -> Path:
    """A finished run with ``names`` as a validation data source, a reward extra field and a raw metric."""
    directory.mkdir(parents=True)
    with (directory / "metrics.jsonl").open("w") as file:
        for step in range(steps):
            record = {"step": step, "critic/score/mean": 0.1 * step, "actor/entropy": 1.0 / (step + 1)}
            for index, name in enumerate(names):
                record[f"val-core/{name}/acc/mean@1"] = 0.2 + 0.1 * index + 0.01 * step
                record[f"reward/extra/{name}/mean"] = 0.5 + index + step
                record[name] = float(index + step)
            file.write(json.dumps(record) + "\n")
    config = {"trainer": {"experiment": experiment}, "reward": {name: 1 for name in names}}
    (directory / RUN_FILE).write_text(json.dumps({"experiment": experiment, "config": config}))
    (directory / STATUS_FILE).write_text(json.dumps({"status": "finished", "step": steps - 1}))
    return directory


@pytest.fixture
def hostile_run(tmp_path):
    return write_run(tmp_path / "hostile", HOSTILE_NAMES[0] + " exp", HOSTILE_NAMES)


def embedded_script(page: str) -> str:
    """The page's own script (after the inlined plotly.js): ``const FIGURES = ...`` to its end."""
    start = page.index("<script>const FIGURES = ")
    return page[start + len("<script>") : page.index("</script>", start)]


def test_no_angle_bracket_inside_the_embedded_json_and_every_hostile_name_survives(hostile_run, tmp_path):
    page = write_report([hostile_run], tmp_path / "report.html").read_text()
    script = embedded_script(page)
    data = script[: script.rindex("; const REFRESH_S")]
    assert "<" not in data  # neither `</script>` nor `<!--` can change how the HTML parser reads the script
    names = {trace.get("name", "") for figure in figures_of(page) for trace in figure["data"]}
    for name in HOSTILE_NAMES:
        assert any(name in drawn for drawn in names), name
    assert "REFRESH_S = 0;" in script  # a finished run: the hostile name did not turn reloading on
    assert html.escape(HOSTILE_NAMES[0]) in page  # the header shows the experiment name as text


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ('"3"', "'step' must be an integer, got '3'"),
        ("[1]", "'step' must be an integer, got [1]"),
        ('{"a": 1}', "'step' must be an integer, got {'a': 1}"),
        ("NaN", "'step' must be an integer, got nan"),
        ("true", "'step' must be an integer, got True"),
        ("2.5", "'step' must be an integer, got 2.5"),
        ("-1", "'step' must be 0 or more, got -1"),
    ],
    ids=["string", "list", "dict", "nan", "bool", "fraction", "negative"],
)
def test_a_step_that_is_not_a_step_is_an_error_naming_file_and_line(tmp_path, capsys, step, message):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(f'{{"step": 0, "x": 1}}\n\n{{"step": {step}, "x": 2}}\n')
    assert main(["report", str(run_dir)]) == 2
    error = capsys.readouterr().err
    assert f"{run_dir / 'metrics.jsonl'} line 3: {message}" in error, error
    assert "Traceback" not in error


def test_a_whole_number_written_as_a_float_is_a_step(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "x": 1}\n{"step": 1.0, "x": 2}\n')
    assert [record["step"] for record in load_run(run_dir).records] == [0, 1]


TRAINER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tandem.report.run_info import RunInfo

    info = RunInfo(Path(sys.argv[1]), "test trainer", "killed", "p", {}, "model", {}, total_steps=10)
    info.start(0)
    (Path(sys.argv[1]) / "metrics.jsonl").write_text('{"step": 1, "x": 1.0}\\n')
    info.progress(1)
    time.sleep(120)
    """
)


def start_trainer(run_dir: Path) -> subprocess.Popen:
    """A real process that records a run as running at step 1, then waits to be killed."""
    process = subprocess.Popen([sys.executable, "-c", TRAINER, str(run_dir)])
    deadline = time.monotonic() + 60
    while not (run_dir / "metrics.jsonl").exists() or load_run(run_dir).status.get("step") != 1:
        assert process.poll() is None, "the trainer stopped before recording a step"
        assert time.monotonic() < deadline, "the trainer never recorded step 1"
        time.sleep(0.05)
    return process


def test_a_trainer_killed_with_sigkill_reads_as_interrupted_not_running(tmp_path, capsys):
    run_dir = tmp_path / "run"
    process = start_trainer(run_dir)
    try:
        live = load_run(run_dir)
        # the reference: a live process is not mistaken for a dead one
        assert live.status["status"] == "running"
        assert live.status["pid"] == process.pid
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert json.loads((run_dir / STATUS_FILE).read_text())["status"] == "running"  # as the killed run left it
    status = load_run(run_dir).status
    assert status["status"] == "interrupted" and status["step"] == 1
    assert f"process {process.pid}" in status["error"] and "gone" in status["error"]

    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    page = html.unescape(out.read_text())
    assert "interrupted at step 1 of 10" in page
    assert "reload every" not in page and "REFRESH_S = 0;" in page  # the page stops reloading

    # the next run in that directory (a resume from step 1) records and says the interruption
    RunInfo(run_dir, "test trainer", "killed", "p", {}, "model", {}, total_steps=10).start(1)
    said = capsys.readouterr().err
    assert f"stopped at step 1 without finishing (process {process.pid} is gone; last update" in said, said
    interrupted = json.loads((run_dir / RUN_FILE).read_text())["interrupted"]
    assert [entry["step"] for entry in interrupted] == [1] and interrupted[0]["pid"] == process.pid
    assert load_run(run_dir).status["status"] == "running"  # the new process is alive
    page = html.unescape(write_report([run_dir], out).read_text())
    assert f"<td>interrupted</td><td>at step 1 (process {process.pid} gone; last update" in page


def test_validation_samples_are_escaped_and_only_png_thumbnails_kept(tmp_path):
    run = write_run(tmp_path / "run", "samples", ("arithmetic",))
    good = thumbnail_url(Image.new("RGB", (400, 200), (200, 10, 10)))
    svg = "data:image/svg+xml;base64," + base64.b64encode(b"<svg onload=alert(1)>").decode()
    append_val_samples(
        run, 2,
        [
            {"prompt": "</pre><script>window.pwned=1</script>", "response": "<img src=x onerror=alert(1)>",
             "score": 1.0, "ground_truth": "<b>", "images": [good, "javascript:alert(1)", svg, good + "' onload='x"]},
        ],
    )  # fmt: skip
    with (run / VAL_SAMPLES_FILE).open("a") as file:
        file.write('{"step": "1", "prompt": "bad step"}\n[1, 2]\n{"step": 3, "prompt": "partial li')
    page = write_report([run], tmp_path / "report.html").read_text()
    section = page[page.index("<h3>Validation samples</h3>") : page.index("Resolved config")]
    assert (
        "<script>window.pwned" not in section
        and html.escape("</pre><script>window.pwned=1</script>") in section
    )
    assert "<img src=x" not in section and "javascript:" not in section and "svg" not in section
    assert section.count("<img class='thumb'") == 1 and good in section
    assert "bad step" not in section and "validation at step 2" in section
    assert Image.open(io.BytesIO(base64.b64decode(good.split(",")[1]))).size == (160, 80)  # a real PNG
