"""Two data-parallel workers (spawned processes, and Ray actors) against one: the same samples, the same update.

Sampling seeds are per request, so the two workers generate exactly the responses the single
worker does; the DDP update of the two halves then equals the single update up to float
summation order.
"""

import importlib.util
import re
import time

import pytest
import torch

from tandem.rl import RLTrainer
from tests.rl.conftest import assert_same_histories, small_config

SAME = ["critic/score/mean", "response_length/mean", "critic/advantages/max", "critic/advantages/min"]
CLOSE = ["actor/pg_loss", "actor/grad_norm", "actor/kl_loss"]
TOKEN_MEANS = ["actor/entropy"]  # one mean over the mini-batch's tokens on any split: rounding only (~1e-7)


@pytest.fixture(scope="module")
def single_worker_run(rl_files, tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    return RLTrainer(small_config(rl_files, out, "trainer.total_steps=1", "data.val_path=")).fit().history


@pytest.mark.parametrize(
    "backend,strategy,sp_size",
    [
        ("local", "single", 1),
        # the same run on Ray actors: a second test of the same thing in other processes (slow tier)
        pytest.param("ray", "single", 1, marks=pytest.mark.slow),
        ("local", "fsdp2", 1),
        ("local", "single", 2),
    ],
    ids=["local-ddp", "ray-ddp", "local-fsdp2", "local-sequence-parallel"],
)
def test_two_workers_match_one(rl_files, tmp_path, single_worker_run, backend, strategy, sp_size, request):
    """DDP (``single`` over two ranks); FSDP2, whose reference model is sharded too; and
    ``actor.engine.sp_size=2``: one data-parallel rank, so both workers get every row
    (dispatched by data-parallel rank) and split each packed row between them, the frozen
    reference too, while generation still spreads the prompts over both."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config = small_config(
        rl_files,
        tmp_path,
        "trainer.total_steps=1",
        "data.val_path=",
        "trainer.n_workers=2",
        f"trainer.backend={backend}",
        f"actor.engine.strategy={strategy}",
        f"actor.engine.sp_size={sp_size}",
    )
    (two,) = RLTrainer(config).fit().history
    (one,) = single_worker_run
    for name in SAME:
        assert two[name] == one[name], name
    for name in CLOSE:
        assert two[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6), name
    for name in TOKEN_MEANS:
        assert two[name] == pytest.approx(one[name], rel=1e-6), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for GPUs that the CPU tier lacks")
@pytest.mark.parametrize("backend", ["local", "ray"])
def test_a_run_asking_for_gpus_that_are_not_there_is_refused_before_workers_start(
    rl_files, tmp_path, backend, request
):
    """With Ray it used to sit out the placement timeout; on one machine, ranks would share a GPU."""
    if backend == "ray":
        request.getfixturevalue("ray_cluster")
    config = small_config(
        rl_files,
        tmp_path,
        f"trainer.backend={backend}",
        "trainer.n_gpus_per_node=2",
        "pipeline.mode=one_step_off",
    )
    start = time.monotonic()
    with pytest.raises(ValueError) as error:
        RLTrainer(config).fit()
    message = str(error.value)
    if backend == "ray":
        assert "needs 3 GPUs (actor_rollout_ref 2, rollout 1) and the Ray cluster has 0" in message
    else:
        assert "pool 'actor_rollout_ref' wants 2 GPU workers on this machine and it sees 0 GPU(s)" in message
    assert (
        "trainer.n_gpus_per_node (or trainer.n_workers)" in message and "pipeline.rollout_replicas" in message
    )
    assert time.monotonic() - start < 20.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that the CPU tier lacks")
@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.device=cuda"], "trainer.device='cuda' asks for a CUDA GPU and this machine sees 0"),
        (["trainer.device=cuda:1"], "trainer.device='cuda:1' asks for a CUDA GPU and this machine sees 0"),
        (
            ["trainer.device=cuda", "trainer.backend=ray"],
            "pool 'actor_rollout_ref' reserves no GPUs and a Ray worker sees only the GPUs it reserves",
        ),
    ],
)
def test_a_cuda_device_that_no_worker_would_see_is_refused_before_workers_start(
    rl_files, tmp_path, overrides, message
):
    """It used to fail inside each worker, after the workers had started."""
    with pytest.raises(ValueError, match=re.escape(message)):
        RLTrainer(small_config(rl_files, tmp_path, *overrides)).fit()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_the_vllm_engine_without_vllm_installed_is_refused_naming_the_key(rl_files, tmp_path):
    with pytest.raises(ValueError, match=re.escape("rollout.engine.name='vllm' needs the vllm package")):
        RLTrainer(small_config(rl_files, tmp_path, "rollout.engine.name=vllm")).fit()


def test_tensor_parallel_actor_matches_one_worker_step_for_step(rl_files, tmp_path):
    """``actor.engine.tp_size=2`` over two workers (one tensor-parallel group, the reference
    split too) against one worker, two steps with a KL loss: the second step generates with
    weights synced from the split actor (gathered whole, one tensor at a time), so its samples,
    scores and losses match only if the sync delivered the unsharded weights.

    Every metric within 1e-5 relative (largest seen: 2e-7, the grad norm), except
    ``rollout_corr/*``: they measure the rounding difference between the rollout's and the
    trainer's fp32 log-probs (about 1e-7 either way), which splitting the sums changes, so they
    are held to 1e-6 absolute."""
    runs = [
        RLTrainer(
            small_config(rl_files, tmp_path / f"tp{tp}", "data.val_path=", f"trainer.n_workers={tp}",
                         f"actor.engine.tp_size={tp}", "algorithm.kl.use_kl_loss=true")
        ).fit().history
        for tp in (1, 2)
    ]  # fmt: skip
    one, two = runs
    assert len(one) == 2
    assert_same_histories(one, two)
    assert one[1]["actor/kl_loss"] > 0  # the second step's policy has moved from the reference
