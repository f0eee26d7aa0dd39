"""A request that finishes with ``error`` raises the same error on every path that generates:
the colocated worker, a replica's prompt groups, and the asynchronous pipeline's validation."""

import pytest
import torch

from tandem.controller import ResourcePool, create_worker_group
from tandem.models import save_tiny_model
from tandem.pipeline.fleet import RolloutFleet
from tandem.pipeline.groups import GroupRequest, GroupTracker
from tandem.pipeline.replica_worker import RolloutReplicaWorker
from tandem.pipeline.sample_queue import SampleQueue
from tandem.pipeline.sample_store import InlineWriter
from tandem.protocol.generation import raise_failed_requests
from tandem.protocol.images import ImageInputs
from tandem.rollout import RolloutRequest, SamplingParams
from tandem.rollout.config import RolloutEngineConfig
from tandem.rollout.native import NativeEngineConfig, NativeRolloutEngine

ENGINE = NativeEngineConfig(max_model_len=64, max_num_seqs=8, device="cpu")
PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=3)
PICTURE = ImageInputs(torch.zeros(4, 8), torch.tensor([[1, 2, 2]]))  # a text-only model refuses it


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("request-errors") / "model"))


def _requests(prefix):
    """Two good requests around one that the engine finishes with ``error`` (images, text model)."""
    return [
        RolloutRequest(f"{prefix}-0", (5, 9, 11), PARAMS),
        RolloutRequest(f"{prefix}-1", (5, 9, 12), PARAMS, PICTURE),
        RolloutRequest(f"{prefix}-2", (5, 9, 13), PARAMS),
    ]


def _expected_error(model_dir, requests, where):
    """The error the shared check raises on the engine's own completions (the reference)."""
    engine = NativeRolloutEngine.from_pretrained(model_dir, ENGINE)
    completions = engine.generate_batch(requests)
    engine.close()
    with pytest.raises(RuntimeError) as expected:
        raise_failed_requests(completions, where)
    return str(expected.value)


def replica_kwargs(model_dir, sample_dir) -> dict:
    """A one-replica group's settings: the tiny model's native engine on the CPU."""
    engine = RolloutEngineConfig(native=ENGINE)
    return {"engine": engine, "model_path": model_dir, "device": "cpu", "sample_dir": str(sample_dir)}


def test_the_shared_check_names_the_first_failed_request(tiny_model_dir):
    engine = NativeRolloutEngine.from_pretrained(tiny_model_dir, ENGINE)
    completions = engine.generate_batch(_requests("val"))
    engine.close()
    assert [c.finish_reason == "error" for c in completions] == [False, True, False]
    raise_failed_requests(completions[::2], "validation")  # no failure: no error
    message = _expected_error(tiny_model_dir, _requests("val"), "validation")
    assert message.startswith("validation: 1 of 3 rollout requests failed; first: request 'val-1'")
    assert "text-only model" in message


def test_async_validation_raises_on_an_error_completion_like_the_sync_path(tiny_model_dir, tmp_path):
    """The fleet's ``generate`` (the asynchronous pipelines' validation) used to hand the failed
    completion on as an empty response; it raises the sync path's error now."""
    requests = _requests("val")
    expected = _expected_error(tiny_model_dir, requests, "validation on the rollout replicas")
    kwargs = replica_kwargs(tiny_model_dir, tmp_path)
    with create_worker_group(RolloutReplicaWorker, ResourcePool((1,)), "local", kwargs=kwargs) as group:
        fleet = RolloutFleet(group, SampleQueue(None), timeout_s=60)
        try:
            with pytest.raises(RuntimeError) as raised:
                fleet.generate(requests)
        finally:
            fleet.close()
    assert str(raised.value) == expected


def test_a_replicas_group_raises_the_same_error(tiny_model_dir):
    """A prompt group whose responses fail raises, on the replica, the check's error."""
    group = GroupRequest("g", 0, (5, 9, 12), (1, 2), PARAMS, images=PICTURE)
    requests = [RolloutRequest(f"g/{i}", group.prompt_ids, PARAMS, PICTURE) for i in range(2)]
    expected = _expected_error(tiny_model_dir, requests, "rollout replica 1")
    engine = NativeRolloutEngine.from_pretrained(tiny_model_dir, ENGINE)
    tracker = GroupTracker(replica=1, writer=InlineWriter())
    tracker.start(engine, [group])
    try:
        with pytest.raises(RuntimeError) as raised:
            for _ in range(400):
                tracker.collect(wait_s=0.05)
    finally:
        engine.close()
    assert str(raised.value) == expected


class BrokenQueue(SampleQueue):
    """A sample queue whose hand-over fails on the controller's side (as a store's error would)."""

    def put(self, groups):
        raise KeyError("nbytes")


def test_a_driver_failing_on_the_controllers_side_is_raised_not_swallowed(tiny_model_dir, tmp_path):
    """Only replica failures were caught: any other error ended the driver thread silently, and
    the trainer waited for groups that would never come."""
    kwargs = replica_kwargs(tiny_model_dir, tmp_path)
    with create_worker_group(RolloutReplicaWorker, ResourcePool((1,)), "local", kwargs=kwargs) as group:
        fleet = RolloutFleet(group, BrokenQueue(None), timeout_s=60)
        try:
            fleet._threads[0].join(timeout=30)  # its first hand-over fails
            assert not fleet._threads[0].is_alive()
            with pytest.raises(RuntimeError, match="driver of rollout replica 0 failed: KeyError") as raised:
                fleet.check()
            assert isinstance(raised.value.__cause__, KeyError)
        finally:
            fleet.close()
