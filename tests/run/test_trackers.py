"""The wandb and MLflow trackers run for real, offline (``WANDB_MODE=offline``, a file-backed
MLflow store), and what each recorded is read back from its files and compared with the JSONL
tracker's record of the same steps: every metric at every step, the config, the names.

Skipped when the package is not installed (the ``dev`` extra installs both)."""

import json
import math
import struct
from pathlib import Path

import pytest

from tandem.report.page import flatten
from tandem.run.trackers import build_trackers, read_jsonl

HOSTILE = "reward/extra/<!--<script>|a@b (c)/mean"  # a reward function's extra field, named by its user
CONFIG = flatten(
    {
        "actor": {"engine": {"lr": 1e-3, "betas": [0.9, 0.999]}},
        "trainer": {"experiment": "lr_1e-3", "loggers": ["jsonl", "wandb", "mlflow"], "total_steps": 3},
        "reward": {"custom_kwargs": {"weird<key>@1": "v"}, "judge": None},
        "data": {f"field_{i}": i for i in range(120)},  # more keys than MLflow takes in one batch (100)
    }
)
STEPS = [
    (0, {"val-core/arithmetic/acc/mean@1": 0.25}),
    (1, {"critic/score/mean": 0.5, "actor/entropy": 1.9, "timing_s/step": 0.8, HOSTILE: 1.0}),
    (2, {"critic/score/mean": 0.75, "actor/entropy": 1.7, "actor/grad_norm": math.nan, HOSTILE: 2.0}),
    (3, {"critic/score/mean": 1.0, "val-core/arithmetic/acc/mean@1": 0.5, "actor/pg_loss": -0.125}),
]


def log_steps(logger: str, output_dir: Path) -> dict[tuple[str, int], float]:
    """Log :data:`STEPS` through the JSONL tracker and ``logger`` together; the JSONL file's
    ``{(metric, step): value}`` (NaN as the string ``nan``), the reference to compare with."""
    trackers = build_trackers(("jsonl", logger), output_dir, 3, 0, False, "tandem-test", "lr_1e-3", CONFIG)
    for step, metrics in STEPS:
        for tracker in trackers:
            tracker.log(metrics, step)
    for tracker in trackers:
        tracker.close()
    return {
        (name, record["step"]): _comparable(value)
        for record in read_jsonl(output_dir / "metrics.jsonl")
        for name, value in record.items()
        if name != "step"
    }


def _comparable(value) -> float | str:
    number = float(value)
    return "nan" if math.isnan(number) else number


# ---------------------------------------------------------------------------- wandb


def wandb_records(path: Path):
    """The records of an offline run's ``.wandb`` file: a 7-byte header, then LevelDB-log blocks
    of 32 KiB, each record split into chunks with a 7-byte header (CRC, length, kind: 1 whole,
    2 first, 3 middle, 4 last); each record is a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a header is padding
            position += 32768 - position % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))  # nothing written to ~
    yield wandb
    wandb.teardown()  # ends the wandb-core service this test started (a no-op when the test did)


def test_wandb_offline_records_every_metric_step_and_the_config(offline_wandb, tmp_path):
    reference = log_steps("wandb", tmp_path)
    offline_wandb.teardown()  # the wandb-core service completes the run file when it shuts down, not at finish()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    recorded, runs = {}, []
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            runs.append(record.run)
        elif kind == "history":
            # a name with "/" is stored as its parts in nested_key
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            step = record.history.step.num
            recorded.update({(k, step): _comparable(v) for k, v in items.items() if not k.startswith("_")})
    assert recorded == reference
    (run,) = runs
    assert (run.project, run.display_name) == ("tandem-test", "lr_1e-3")
    config = {item.key: json.loads(item.value_json) for item in run.config.update if item.key != "_wandb"}
    assert config == CONFIG


# ---------------------------------------------------------------------------- MLflow


def mlflow_run(store: Path) -> Path:
    """The one run directory of the one experiment in a file store (``<experiment id>/<run id>``)."""
    runs = [meta.parent for meta in store.glob("*/*/meta.yaml")]
    assert len(runs) == 1, runs
    return runs[0]


def test_mlflow_file_store_records_every_metric_step_and_the_config(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store.as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this flag
    reference = log_steps("mlflow", tmp_path / "out")
    run = mlflow_run(store)
    recorded = {}
    for path in (run / "metrics").rglob("*"):
        if path.is_file():
            for line in path.read_text().splitlines():  # "<timestamp ms> <value> <step>"
                _, value, step = line.split()
                recorded[(path.relative_to(run / "metrics").as_posix(), int(step))] = _comparable(value)
    # MLflow takes letters, digits and _ - . / : and spaces in names; the rest become "_" ("@": "_at_")
    renamed = {
        "val-core/arithmetic/acc/mean@1": "val-core/arithmetic/acc/mean_at_1",
        HOSTILE: "reward/extra/__--_script__a_at_b _c_/mean",
    }
    assert recorded == {(renamed.get(name, name), step): value for (name, step), value in reference.items()}
    params = {
        path.relative_to(run / "params").as_posix(): path.read_text()
        for path in (run / "params").rglob("*")
        if path.is_file()
    }
    assert params == {
        ("reward.custom_kwargs.weird_key__at_1" if "weird" in key else key): str(value)
        for key, value in CONFIG.items()
    }
    meta = (run / "meta.yaml").read_text()
    assert "run_name: lr_1e-3" in meta and "status: 3" in meta  # 3: FINISHED
    assert "name: tandem-test" in (run.parent / "meta.yaml").read_text()
