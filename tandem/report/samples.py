"""Validation samples beside a run (``val_samples.jsonl``) and their section of the report.

At each validation step the RL trainer appends a few rows: the prompt's text, the response,
its score and ground truth, a vision-language prompt's pictures as small PNG thumbnails
(``data:`` URLs), and an agent program's log (``program_log``: its fault, and the program's
stdout and stderr as kept; only the non-empty ones). The report shows each validation step's
samples, the latest first, a program's log under its response.

The file is read as untrusted: every text is escaped, a thumbnail is kept only when it is a
base64 PNG ``data:`` URL, and a line that is not a JSON object is skipped (a run still being
written may end in a partial line).
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Sequence
from pathlib import Path

VAL_SAMPLES_FILE = "val_samples.jsonl"
THUMBNAIL_SIDE = 160  # pixels: the longer side of a thumbnail
PNG_DATA_URL = re.compile(r"data:image/png;base64,[A-Za-z0-9+/]+={0,2}")
TEXT_FIELDS = ("prompt", "response", "ground_truth")
MAX_TEXT = 2000  # characters of each text shown
PROGRAM_LOG_FIELDS = ("error", "stdout", "stderr")  # an agent program's log, in the order shown


def thumbnail_url(image) -> str:
    """A PIL image as a PNG ``data:`` URL no larger than :data:`THUMBNAIL_SIDE` on its longer side."""
    small = image.copy()
    small.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
    buffer = io.BytesIO()
    small.convert("RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def append_val_samples(directory: str | Path, step: int, samples: Sequence[dict]) -> None:
    """Append ``samples`` (dicts with ``prompt``, ``response``, ``score``, ``ground_truth`` and
    optional ``images``: thumbnail URLs, and ``program_log``: ``{"error", "stdout", "stderr"}``)
    of validation at ``step`` to the run's file."""
    path = Path(directory) / VAL_SAMPLES_FILE
    with path.open("a") as file:
        for sample in samples:
            file.write(json.dumps({"step": step, **sample}) + "\n")


def read_val_samples(directory: str | Path) -> list[dict]:
    """The run's validation samples, cleaned (see the module docstring); empty without the file."""
    path = Path(directory) / VAL_SAMPLES_FILE
    if not path.is_file():
        return []
    samples = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict) or not isinstance(raw.get("step"), int) or isinstance(raw["step"], bool):
            continue
        score = raw.get("score")
        images = raw.get("images") if isinstance(raw.get("images"), list) else []
        log = raw.get("program_log") if isinstance(raw.get("program_log"), dict) else {}
        samples.append(
            {
                "step": raw["step"],
                **{name: str(raw.get(name, ""))[:MAX_TEXT] for name in TEXT_FIELDS},
                "score": float(score)
                if isinstance(score, (int, float)) and not isinstance(score, bool)
                else None,
                "images": [url for url in images if isinstance(url, str) and PNG_DATA_URL.fullmatch(url)],
                "program_log": {
                    name: str(log[name])[:MAX_TEXT] for name in PROGRAM_LOG_FIELDS if log.get(name)
                },
            }
        )
    return samples


def samples_html(samples: list[dict]) -> str:
    """Each validation step's samples as a table (prompt with its pictures, response with an agent
    program's log, score, ground truth), the latest step first and open."""
    if not samples:
        return ""
    steps = sorted({sample["step"] for sample in samples}, reverse=True)
    parts = []
    for i, step in enumerate(steps):
        rows = []
        for sample in (s for s in samples if s["step"] == step):
            pictures = "".join(
                f"<img class='thumb' src='{url}' alt='prompt image'>" for url in sample["images"]
            )
            score = "" if sample["score"] is None else f"{sample['score']:.3g}"
            log = "".join(
                f"<div class='program-log'>agent program {name}:<pre>{html.escape(text)}</pre></div>"
                for name, text in sample["program_log"].items()
            )
            cells = [
                pictures + f"<pre>{html.escape(sample['prompt'])}</pre>",
                f"<pre>{html.escape(sample['response'])}</pre>{log}",
                html.escape(score),
                html.escape(sample["ground_truth"]),
            ]
            rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
        header = "<tr><th>prompt</th><th>response</th><th>score</th><th>ground truth</th></tr>"
        parts.append(
            f"<details{' open' if i == 0 else ''}><summary>validation at step {step}</summary>"
            f"<table class='samples'>{header}{''.join(rows)}</table></details>"
        )
    return "".join(parts)
