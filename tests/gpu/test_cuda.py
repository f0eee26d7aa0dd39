"""The GPU tier (``pytest -m gpu``): CUDA runs against their CPU references. Skipped without CUDA.

- an FSDP2 bf16 mixed-precision train step on CUDA agrees with the fp32 CPU step;
- the native engine's log-probs on CUDA (fp32) match the trainer's on CUDA;
- GRPO end to end on CUDA with 1 worker, and with 2 when the machine has 2 GPUs;
- a one-step-off run whose replica syncs by NCCL broadcast binds the GPU after the trainer's;
- more workers than GPUs on one machine with ``device=auto`` is refused before they start;
- offloading: an FSDP2 engine's state leaves the GPU and comes back without changing the next
  step, and the colocated loop with ``actor.offload.*`` generates with less memory allocated
  and logs the numbers of a run that offloads nothing.
"""

from __future__ import annotations

import functools
import math
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.models import TinyModelConfig, load_model, save_tiny_model
from tandem.rl import RLTrainer
from tandem.rl.derived import replica_plan
from tandem.rollout import NativeEngineConfig, NativeRolloutEngine, RolloutRequest, SamplingParams
from tandem.sft.loss import sft_loss
from tests.conftest import ROOT
from tests.engine.conftest import random_batch
from tests.rl.conftest import small_config
from tests.rollout.test_native_engine import random_prompts, trainer_log_probs

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(
        save_tiny_model(tmp_path_factory.mktemp("gpu") / "qwen2", TinyModelConfig(family="qwen2", seed=3))
    )


def _one_step(model_dir: str, **overrides) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Loss, gradient norm and the parameters (on the CPU) after one AdamW step on a fixed batch."""
    # eps=1e-3 keeps Adam's first step from turning bf16 sign flips of tiny gradients into lr-sized moves
    engine = TorchTrainEngine(EngineConfig(model_path=model_dir, lr=1e-3, eps=1e-3, **overrides))
    engine.initialize()
    batch = random_batch(0)
    normalizer = engine.global_normalizer(batch["loss_mask"])
    result = engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
    grad_norm = engine.optimizer_step()
    return result.loss, grad_norm, {name: t.detach().float().cpu() for name, t in engine.iter_parameters()}


@pytest.fixture
def nccl_world_of_one():
    """A process group of this one GPU, for FSDP2 (which shards over a process group)."""
    dist.init_process_group(
        "nccl", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    yield
    dist.destroy_process_group()


def test_fsdp2_bf16_step_on_cuda_agrees_with_the_cpu_fp32_step(model_dir, nccl_world_of_one):
    loss_cpu, norm_cpu, params_cpu = _one_step(model_dir, device="cpu")
    loss_gpu, norm_gpu, params_gpu = _one_step(
        model_dir, device="cuda", strategy="fsdp2", mixed_precision="bf16"
    )
    assert loss_gpu == pytest.approx(loss_cpu, rel=2e-2)
    assert norm_gpu == pytest.approx(norm_cpu, rel=5e-2)
    for name, tensor in params_gpu.items():
        torch.testing.assert_close(tensor, params_cpu[name], rtol=0, atol=2e-3, msg=name)


def test_native_engine_log_probs_on_cuda_match_the_trainers(model_dir):
    engine = NativeRolloutEngine.from_pretrained(
        model_dir, NativeEngineConfig(device="cuda", max_num_seqs=32, max_model_len=128)
    )
    try:
        assert engine.device.type == "cuda" and engine.cache.keys[0].is_cuda
        prompts = random_prompts(24, 5)
        params = SamplingParams(temperature=1.0, max_tokens=32)
        completions = engine.generate_batch(
            [RolloutRequest(f"g{i}", p, params) for i, p in enumerate(prompts)], timeout=300
        )
    finally:
        engine.close()
    expected = trainer_log_probs(model_dir, prompts, completions, 1.0, device="cuda")
    worst = max(
        (torch.tensor(c.log_probs) - e.cpu()).abs().max().item()
        for c, e in zip(completions, expected, strict=True)
    )
    assert worst <= 1e-4


def _on_gpus(gpus: int, steps: int) -> list[str]:
    """Overrides for a run of ``steps`` steps on ``gpus`` GPUs without validation (skips when the
    machine has fewer)."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    return [
        f"trainer.total_steps={steps}",
        "trainer.device=cuda",
        f"trainer.n_gpus_per_node={gpus}",
        "data.val_path=",
    ]


@pytest.mark.parametrize("gpus", [1, 2])
def test_grpo_steps_end_to_end_on_cuda(rl_files, tmp_path, gpus):
    history = RLTrainer(small_config(rl_files, tmp_path, *_on_gpus(gpus, steps=3))).fit().history
    assert [h["step"] for h in history] == [1, 2, 3]
    for metrics in history:
        assert math.isfinite(metrics["actor/pg_loss"]) and math.isfinite(metrics["actor/grad_norm"])
        assert metrics["rollout_corr/max_abs_log_prob_diff"] < 1e-3
        assert metrics["perf/max_memory_allocated_gb/update_actor"] > 0


def _fsdp2_two_steps(model_dir: str, offload_between: bool) -> tuple[dict[str, torch.Tensor], int]:
    """Parameters after two FSDP2 steps on CUDA, and the bytes an offload between them freed (or 0)."""
    # eps=1e-3: run-to-run float noise (CUDA's atomic index_add) is not blown up to lr-sized steps by
    # Adam's near-sign first update of tiny gradients
    config = EngineConfig(model_path=model_dir, lr=1e-3, eps=1e-3, device="cuda", strategy="fsdp2")
    engine = TorchTrainEngine(config)
    engine.initialize()
    batch = random_batch(0)
    freed = 0
    for step in range(2):
        if step and offload_between:
            resident = torch.cuda.memory_allocated()
            engine.offload()
            freed = resident - torch.cuda.memory_allocated()
            assert all(p.is_cuda for p in engine.causal_lm.parameters())  # the same tensors, storage freed
            engine.reload()
        normalizer = engine.global_normalizer(batch["loss_mask"])
        engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
        engine.optimizer_step()
    return {name: t.detach().cpu() for name, t in engine.iter_parameters()}, freed


def test_an_fsdp2_offload_round_trip_frees_the_gpu_and_changes_nothing(model_dir, nccl_world_of_one):
    kept, _ = _fsdp2_two_steps(model_dir, offload_between=False)
    moved, freed = _fsdp2_two_steps(model_dir, offload_between=True)
    parameters = sum(p.numel() for p in load_model(model_dir).parameters())
    assert freed >= 0.9 * 12 * parameters  # fp32 parameters and AdamW's two moments left the GPU
    for name, tensor in kept.items():
        torch.testing.assert_close(moved[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("gpus,strategy", [(1, "single"), (2, "ddp"), (2, "fsdp2")])
def test_offloading_in_the_colocated_loop_on_cuda_saves_generation_memory_and_changes_nothing(
    rl_files, tmp_path, gpus, strategy
):
    """Actor parameters, optimizer state and reference off the GPU while generating: the
    generation phase's peak falls by about their size (16 bytes per parameter at step 2, once
    AdamW has its moments; FSDP2 shards them over the ranks), and the metrics equal a
    run that offloads nothing."""
    overrides = [
        *_on_gpus(gpus, steps=2),
        f"actor.engine.strategy={strategy}",
        "algorithm.kl.use_kl_loss=true",
        "actor.engine.eps=1e-3",  # see _fsdp2_two_steps: two CUDA runs agree to float noise, not bits
    ]
    offload = ["actor.offload.params=true", "actor.offload.optimizer=true", "actor.offload.reference=true"]
    plain = RLTrainer(small_config(rl_files, tmp_path / "plain", *overrides)).fit().history
    offloaded = RLTrainer(small_config(rl_files, tmp_path / "offloaded", *overrides, *offload)).fit().history
    parameters = sum(p.numel() for p in load_model(rl_files["model"]).parameters())
    saved_gb = plain[1]["perf/max_memory_allocated_gb/gen"] - offloaded[1]["perf/max_memory_allocated_gb/gen"]
    shards = gpus if strategy == "fsdp2" else 1  # FSDP2 shards the actor and the reference
    peaks = {  # in the message: on an H200 the offloaded run's peak was 89 MB above the plain one's
        run: {k: v for k, v in history[1].items() if k.startswith("perf/max_memory_allocated_gb/")}
        for run, history in (("plain", plain), ("offloaded", offloaded))
    }
    assert saved_gb >= 0.9 * (12 * parameters + 4 * parameters) / shards / 1e9, (parameters, peaks)
    for a, b in zip(plain, offloaded, strict=True):
        for name in (
            "critic/score/mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "actor/kl_loss",
            "rollout_corr/kl",
        ):
            assert b[name] == pytest.approx(a[name], rel=1e-4, abs=1e-6), name


def test_a_replica_broadcasting_by_nccl_binds_the_gpu_after_the_trainers(rl_files, tmp_path):
    """NCCL refuses two ranks of one group on one GPU: with two GPUs the replica takes the second
    and the run trains; with one, the run is refused up front, naming the keys."""
    overrides = [
        "trainer.total_steps=2",
        "trainer.device=cuda",
        "trainer.n_gpus_per_node=1",
        "data.val_path=",
        "pipeline.mode=one_step_off",
        "pipeline.checkpoint_engine.backend=broadcast",
    ]
    config = small_config(rl_files, tmp_path, *overrides)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="pipeline.checkpoint_engine.backend=broadcast"):
            replica_plan(config)
        return
    history = RLTrainer(config).fit().history
    assert [h["step"] for h in history] == [1, 2]
    assert all(h["pipeline/weight_sync_gbps"] > 0 for h in history)


def test_inputs_sent_without_waiting_arrive_intact_behind_queued_work():
    """to_device copies to the GPU without waiting for it; host tensors may change right after."""
    from tandem.device import host_buffer, to_device

    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(20):  # a queue of work the copies must not wait for, nor overtake wrongly
        busy = busy @ busy / 2048
    host = torch.arange(1_000_000, dtype=torch.float32)
    sent = to_device(host, "cuda")
    host.zero_()  # pageable source: staged at once, so this cannot reach the copy
    assert torch.equal(sent.cpu(), torch.arange(1_000_000, dtype=torch.float32))
    assert host_buffer(64, "cuda").is_pinned()


def test_only_visible_gpu_leaves_this_process_every_gpu_it_saw():
    """In a fresh process whose CUDA runtime has not started, a CUDA call inside the narrowed
    block must not start it with the narrowed view (the trainer's cuda:N would vanish)."""
    code = (
        "import torch\n"
        "from tandem.device import only_visible_gpu\n"
        "count = torch.cuda.device_count()\n"
        "assert not torch.cuda.is_initialized()\n"
        "with only_visible_gpu(f'cuda:{count - 1}'):\n"
        "    started_before = torch.cuda.is_initialized()\n"
        "    torch.zeros(1, device='cuda')\n"
        "print(started_before, count, torch.cuda.device_count(), torch.cuda.get_device_name(count - 1) != '')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    count = torch.cuda.device_count()
    assert done.stdout.split() == ["True", str(count), str(count), "True"]


def test_more_auto_device_workers_than_gpus_are_refused_before_they_start():
    """``auto`` lands every worker on CUDA here, and NCCL refuses two ranks on one GPU."""
    from tandem.controller import ResourcePool, check_placement

    workers = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=f"wants {workers} GPU workers on this machine"):
        check_placement([ResourcePool((workers,))], "process", "k", device=("trainer.device", "auto"))
    check_placement([ResourcePool((workers,))], "process", "k", device=("trainer.device", "cpu"))
