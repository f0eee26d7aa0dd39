"""WorkerGroup behaviour, the same tests on every backend (in-process, spawned processes, Ray)."""

import os
import signal
import socket
import time

import pytest
import torch

from tandem.controller import (
    DispatchError,
    DispatchMode,
    GroupFuture,
    ResourcePool,
    Role,
    WorkerDiedError,
    WorkerError,
    create_colocated_group,
    create_role_groups,
    create_worker_group,
    register_dispatch_mode,
)
from tandem.protocol import Batch
from tests.controller.workers import ActorRole, BrokenWorker, EchoWorker, ParentWorker, RolloutRole


def numbered(size: int) -> Batch:
    return Batch(
        {"x": torch.arange(size, dtype=torch.float32).unsqueeze(-1)}, {"uid": [f"s{i}" for i in range(size)]}
    )


def test_ranks_and_world_size(echo_group, backend_world):
    _, world = backend_world
    info = echo_group.whoami()
    assert [(r, w) for r, w, _ in info] == [(r, world) for r in range(world)]
    pids = {pid for _, _, pid in info}
    assert len(pids) == world
    if backend_world == ("local", 1):
        assert pids == {os.getpid()}  # in-process
    else:
        assert os.getpid() not in pids


def test_host_pids_are_the_processes_running_the_ranks(echo_group):
    """What the controller may clean up after (shared-memory files by process id), on every backend."""
    assert sorted(echo_group.backend.host_pids) == sorted(pid for _, _, pid in echo_group.whoami())


def test_ray_workers_of_a_pool_without_gpus_see_none(echo_group, backend_world):
    """Recent Ray no longer hides the GPUs from an actor that reserved none: the group does,
    so a CPU pool on a GPU machine never computes on a GPU it did not reserve."""
    if backend_world[0] != "ray":
        pytest.skip("the local backends show every worker what the launcher shows")
    assert echo_group.visible_gpus() == [""] * backend_world[1]


def test_the_rendezvous_port_is_held_from_the_moment_it_is_named(echo_group, backend_world):
    """A port found free and bound later can be taken in between; the store naming it holds it."""
    if backend_world[1] == 1:
        pytest.skip("a world of one meets no one")
    (port,) = set(echo_group.rendezvous_port())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock, pytest.raises(OSError):
        sock.bind(("127.0.0.1", port))  # every rank runs on this machine, the store's host too


@pytest.mark.parametrize("size", [1, 4, 5, 7])
def test_dp_compute_splits_pads_and_collects(echo_group, size):
    batch = numbered(size)
    out = echo_group.double(batch)
    assert len(out) == size
    torch.testing.assert_close(out["y"], batch["x"] * 2)
    assert list(out["uid"]) == list(batch["uid"])
    world = echo_group.world_size
    per_rank = -(-size // world)  # each rank got one padded chunk of ceil(size / world)
    assert out["rank"].tolist() == [i // per_rank for i in range(size)]


def test_one_to_all_all_to_all_and_rank_zero(echo_group):
    world = echo_group.world_size
    assert echo_group.sum_of(numbered(4)) == [(4, 6.0)] * world
    assert echo_group.add_rank(list(range(10, 10 + world)), offset=[100] * world) == [
        110 + 2 * r for r in range(world)
    ]
    assert echo_group.rank_zero_only() == 0
    assert echo_group.executed_on_zero() == [0]


def test_bad_dispatch_input_is_a_clear_error(echo_group):
    world = echo_group.world_size
    with pytest.raises(DispatchError, match=f"one value per worker \\({world}\\)"):
        echo_group.add_rank([1] * (world + 1))
    with pytest.raises(DispatchError, match="DP_COMPUTE splits Batch arguments; argument 0 is a list"):
        echo_group.double([1, 2, 3])


def test_gloo_all_reduce_across_workers(echo_group):
    world = echo_group.world_size
    expected = float(sum(r + 1 for r in range(world)) * 2.5)
    assert echo_group.all_reduce(2.5) == [expected] * world


def test_futures_chain_without_blocking(echo_group):
    echo_group.set_delay(1.0)
    start = time.monotonic()
    first = echo_group.double_later(numbered(5))
    second = echo_group.add_one_later(first)  # consumes the pending result rank by rank
    submitted_s = time.monotonic() - start
    assert isinstance(first, GroupFuture) and isinstance(second, GroupFuture)
    assert submitted_s < 0.5, f"submitting two chained calls took {submitted_s:.2f} s: the controller waited"
    assert not second.done()
    out = second.result(timeout=60)
    assert time.monotonic() - start >= 1.0
    echo_group.set_delay(0.0)
    torch.testing.assert_close(out["y"], numbered(5)["x"] * 2 + 1)
    assert len(out) == 5  # the padding added by the first call is removed at the end
    assert all(log[-2:] == ["double_later", "add_one_later"] for log in echo_group.call_log())


def test_future_into_one_to_all_is_collected_on_the_backend(echo_group):
    pending = echo_group.double_later(numbered(3))
    sums = echo_group.sum_of(pending)  # every rank gets the whole collected, unpadded batch
    assert sums == [(3, 3.0)] * echo_group.world_size


def test_worker_exception_reaches_controller_with_rank_and_traceback(echo_group):
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        echo_group.fail("boom in the worker")
    assert time.monotonic() - start < 10
    error = info.value
    assert error.rank == echo_group.world_size - 1 and error.method == "fail"
    assert "ValueError: boom in the worker" in error.remote_traceback
    assert "workers.py" in error.remote_traceback  # the worker-side frame
    assert echo_group.whoami()  # the group still serves calls after a worker error


def test_killed_worker_is_detected(fresh_echo_group, backend_world):
    echo_group = fresh_echo_group
    if backend_world == ("local", 1):
        pytest.skip("an in-process worker cannot be killed without killing the controller")
    victim = echo_group.whoami()[-1][2]
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        echo_group.sleep(0.1)
    assert time.monotonic() - start < 30
    assert info.value.rank == echo_group.world_size - 1


def test_a_killed_worker_is_restarted(fresh_echo_group, backend_world):
    """``restart`` replaces one rank's process: later calls reach the new one, with the same
    place in the group; the other ranks are untouched."""
    echo_group = fresh_echo_group
    if backend_world == ("local", 1):
        with pytest.raises(ValueError, match="cannot restart"):
            echo_group.restart(0)
        return
    before = echo_group.whoami()
    victim = before[-1][2]
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerDiedError):
        echo_group.whoami()
    echo_group.restart(echo_group.world_size - 1)
    after = echo_group.whoami()
    assert [(r, w) for r, w, _ in after] == [(r, w) for r, w, _ in before]
    assert [pid for _, _, pid in after[:-1]] == [pid for _, _, pid in before[:-1]]
    assert after[-1][2] != victim
    assert victim not in echo_group.backend.host_pids and after[-1][2] in echo_group.backend.host_pids


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_a_killed_workers_children_end_with_the_group():
    """A worker may start processes (vLLM's engine core); killed outright, it cannot stop them,
    so the group's shutdown ends the worker's whole process group."""
    group = create_worker_group(ParentWorker, ResourcePool((1,)), "process")
    worker, *children = group.start_children()[0]
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.5)
    assert all(_running(pid) for pid in children)  # orphans, until the shutdown
    group.shutdown()
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in children)


def test_killed_worker_during_a_call_is_detected(fresh_echo_group, backend_world):
    echo_group = fresh_echo_group
    if backend_world == ("local", 1):
        pytest.skip("an in-process worker cannot be killed without killing the controller")
    victim = echo_group.whoami()[0][2]
    echo_group.set_delay(30)
    pending = echo_group.double_later(numbered(4))
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        pending.result(timeout=60)
    assert time.monotonic() - start < 30 and info.value.rank == 0


def test_mesh_dispatch_uses_declared_dp_ranks(echo_group):
    world = echo_group.world_size
    tp = 2 if world == 2 else 1
    echo_group.join_mesh(tp)
    batch = numbered(5)
    out = echo_group.mesh_double(batch)
    torch.testing.assert_close(out["y"], batch["x"] * 2)
    assert len(out) == 5
    assert set(out["rank"].tolist()) == {0}  # with tp=2 both ranks hold dp rank 0; only rank 0 is collected


def test_custom_dispatch_mode():
    def split(group, args, kwargs):
        return [(args[0] * (r + 1),) for r in range(group.world_size)], [{}] * group.world_size, None

    mode = register_dispatch_mode(DispatchMode("SCALED_BY_RANK", split, lambda group, outs, ctx: sum(outs)))
    from tandem.controller import Worker, register

    class Summer(Worker):
        @register(dispatch=mode)
        def identity(self, value):
            return value

    with create_worker_group(Summer) as group:
        assert group.identity(5) == 5
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode(DispatchMode("SCALED_BY_RANK", split, lambda *a: None))


def test_colocated_roles_share_one_process(backend_world):
    backend, world = backend_world
    roles = {"actor": Role(ActorRole, kwargs={"lr": 0.5}), "rollout": Role(RolloutRole)}
    group = create_colocated_group(roles, ResourcePool((world,)), backend)
    try:
        assert group.actor.pid() == group.rollout.pid()
        assert len(set(group.actor.pid())) == world
        assert group.rollout.rank_seen() == list(range(world))
        assert group.actor.step() == [1.5] * world
        torch.testing.assert_close(group.rollout.generate(numbered(3))["y"], numbered(3)["x"])
        assert group.rollout.all_reduce(2.5) == [sum(r + 1 for r in range(world)) * 2.5] * world
    finally:
        group.shutdown()


def test_role_groups_on_separate_and_shared_pools(backend_world):
    backend, world = backend_world
    pools = {"train": ResourcePool((world,), name="train"), "gen": ResourcePool((1,), name="gen")}
    roles = {
        "actor": Role(ActorRole, kwargs={"lr": 1.0}),
        "ref": Role(ActorRole, kwargs={"lr": 0.0}),
        "rollout": Role(RolloutRole),
    }
    views = create_role_groups(roles, {"actor": "train", "ref": "train", "rollout": "gen"}, pools, backend)
    try:
        assert views["actor"].pid() == views["ref"].pid()  # colocated on the train pool
        assert (
            views["actor"].group is views["ref"].group and views["rollout"].group is not views["actor"].group
        )
        if backend != "local" or world > 1:  # separate pools are separate processes
            assert not set(views["rollout"].pid()) & set(views["actor"].pid())
        assert views["actor"].world_size == world and views["rollout"].world_size == 1
    finally:
        views["actor"].group.shutdown()
        views["rollout"].group.shutdown()
    with pytest.raises(ValueError, match="roles \\['ref'\\] have no pool"):
        create_role_groups(roles, {"actor": "train", "rollout": "gen"}, pools, backend)


def test_failing_constructor_is_reported(backend_world):
    backend, world = backend_world
    with pytest.raises((WorkerError, Exception), match="cannot build this worker"):
        group = create_worker_group(BrokenWorker, ResourcePool((world,)), backend)
        group.whoami() if hasattr(group, "whoami") else group.execute_all("_tandem_pid")


def test_unknown_backend_names_the_field():
    with pytest.raises(ValueError, match="worker_group.backend='slurm'"):
        create_worker_group(EchoWorker, backend="slurm")


def test_futures_chain_across_groups(backend_world):
    backend, world = backend_world
    a = create_worker_group(EchoWorker, ResourcePool((world,)), backend)
    b = create_worker_group(EchoWorker, ResourcePool((world,)), backend)
    try:
        a.set_delay(1.0)
        start = time.monotonic()
        pending = b.add_one_later(a.double_later(numbered(4)))
        assert time.monotonic() - start < 0.5  # group b's call was queued without waiting for group a
        out = pending.result(timeout=60)
        torch.testing.assert_close(out["y"], numbered(4)["x"] * 2 + 1)
    finally:
        a.shutdown()
        b.shutdown()


def test_in_process_blocking_calls_run_on_the_callers_thread_after_queued_work():
    import threading

    with create_worker_group(EchoWorker, ResourcePool((1,)), "local") as group:
        assert group.thread_id() == [threading.get_ident()]  # idle: runs right here
        group.set_delay(0.3)
        pending = group.double_later(Batch({"x": torch.ones(2, 1)}))  # queued on the mailbox thread
        assert group.thread_id() != [threading.get_ident()]  # waits its turn behind the queued call
        assert group.call_log() == [["thread_id", "double_later", "thread_id"]]
        assert pending.result()["y"].tolist() == [[2.0], [2.0]]
