"""Worker processes forked from the preloaded fork server (tandem.controller.local) start with what a
spawned one would take from the controller at its start: the environment, the working directory and
``sys.path`` as they are when the group starts, not as they were when the server started. The
reference is the controller's own state at that moment (what ``spawn`` hands a child)."""

import os

import pytest

from tandem.controller import ResourcePool, create_worker_group
from tandem.device import worker_start_method
from tests.controller.workers import EchoWorker, ParentStateWorker


def test_workers_forked_later_take_the_controllers_state_of_that_moment(tmp_path, monkeypatch):
    if worker_start_method() != "forkserver":
        pytest.skip("workers are spawned on a host with CUDA")
    first = create_worker_group(EchoWorker, ResourcePool((1,)), "process")  # the server runs from here on
    first.shutdown()
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "late_module.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("TANDEM_TEST_LATE_VARIABLE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    group = create_worker_group(
        ParentStateWorker,
        ResourcePool((2,)),
        "process",
        kwargs={"variable": "TANDEM_TEST_LATE_VARIABLE", "module": "late_module"},
    )
    try:
        expected = (os.environ["TANDEM_TEST_LATE_VARIABLE"], os.getcwd(), True)
        assert group.state() == [expected, expected]
    finally:
        group.shutdown()

