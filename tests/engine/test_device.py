"""The one place that decides devices, tested with ``device=cpu``; bf16 mixed precision against fp32."""

import functools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tandem.device import (
    bind_device,
    check_device_setting,
    host_buffer,
    host_tensor,
    max_memory_allocated_gb,
    only_visible_gpu,
    process_group_backend,
    resolve_device,
    uses_cpu_kernels,
    uses_cuda_graphs,
)
from tandem.engine import EngineConfig, TorchTrainEngine
from tandem.kernels.cpu import enable_cpu_kernels
from tandem.kernels.cpu.linear import CPULinear
from tandem.models import TinyModelConfig, build_tiny_model
from tandem.sft.loss import sft_loss
from tests.engine.bf16_cpu import needs_bf16_cpu
from tests.engine.conftest import random_batch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's answers")


@no_cuda
def test_auto_and_cpu_resolve_to_the_cpu_and_cuda_without_a_gpu_is_an_error():
    assert resolve_device("auto") == resolve_device("cpu") == bind_device("auto", 3) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    assert max_memory_allocated_gb("cpu") is None


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cpu:0", "tpu", ""])
def test_bad_device_settings_name_the_field(bad):
    with pytest.raises(ValueError, match=f"trainer.device={bad!r} is not allowed"):
        check_device_setting("trainer", "device", bad)
    with pytest.raises(ValueError, match="engine.device"):
        EngineConfig(device=bad)


def test_the_process_group_backend_follows_the_device():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend(torch.device("cuda", 1)) == "nccl"
    assert uses_cpu_kernels("cpu") and not uses_cpu_kernels("cuda:0")
    assert uses_cuda_graphs("cuda:0") and not uses_cuda_graphs("cpu")


def _child_sees() -> str:
    code = "import os; print(os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>'))"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.parametrize(
    ("visible", "setting", "child"),
    [
        ("4,6", "cuda:1", "6"),  # this process's cuda:1 is the machine's GPU 6
        (None, "cuda:3", "3"),
        ("GPU-a1, GPU-b2", "cuda:0", "GPU-a1"),
        ("4,6", "cuda", "4,6"),  # no index: vLLM chooses among what this process sees
        ("4,6", "cpu", "4,6"),
        (None, "auto", "<unset>"),
    ],
)
def test_a_child_started_inside_only_visible_gpu_sees_the_ranks_gpu(monkeypatch, visible, setting, child):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with only_visible_gpu(setting):
        assert _child_sees() == child
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == visible  # restored, or still unset


@pytest.mark.parametrize(
    ("visible", "setting", "count", "child"),
    [
        ("4,5,6,7", "cuda:1", 2, "5,6"),  # a tensor-parallel engine of 2 from this process's cuda:1
        (None, "cuda:2", 3, "2,3,4"),
    ],
)
def test_a_tensor_parallel_engine_sees_its_consecutive_gpus(monkeypatch, visible, setting, count, child):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with only_visible_gpu(setting, count):
        assert _child_sees() == child


def test_only_visible_gpu_refuses_a_gpu_this_process_cannot_see(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    refused = pytest.raises(RuntimeError, match="GPU 2 is not among CUDA_VISIBLE_DEVICES='4,6'")
    with refused, only_visible_gpu("cuda:2"):
        pass
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"


def test_host_buffers_are_page_locked_only_for_a_gpu():
    buffer = host_buffer(40, "cpu")
    assert buffer.shape == (40,) and buffer.dtype == torch.uint8 and not buffer.is_pinned()
    if torch.cuda.is_available():
        assert host_buffer(40, "cuda:0").is_pinned()


def test_host_tensors_keep_values_and_dtype():
    ids = host_tensor([3, -1, 2**40], torch.int64, "cpu")
    assert ids.tolist() == [3, -1, 2**40] and ids.dtype == torch.int64
    assert host_tensor([True, False], torch.bool, torch.device("cpu")).tolist() == [True, False]


def test_cpu_kernels_are_switched_on_for_the_cpu_only():
    model = build_tiny_model(
        TinyModelConfig(family="qwen2"), vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    assert not enable_cpu_kernels(model, torch.device("cuda", 0))  # a GPU model is left alone
    assert not any(isinstance(m, CPULinear) for m in model.modules())
    assert enable_cpu_kernels(model, torch.device("cpu"))
    assert not any(type(m) is nn.Linear for m in model.modules())


def _one_step(model_dir: str, **overrides) -> tuple[float, float, dict[str, torch.Tensor]]:
    """Loss, gradient norm and the parameters after one AdamW step on a fixed batch."""
    engine = TorchTrainEngine(EngineConfig(model_path=model_dir, lr=1e-3, device="cpu", **overrides))
    engine.initialize()
    batch = random_batch(0)
    normalizer = engine.global_normalizer(batch["loss_mask"])
    result = engine.forward_backward(batch, functools.partial(sft_loss, normalizer=normalizer))
    grad_norm = engine.optimizer_step()
    return result.loss, grad_norm, {name: tensor.clone() for name, tensor in engine.iter_parameters()}


@needs_bf16_cpu
def test_bf16_mixed_precision_step_agrees_with_fp32_and_keeps_fp32_master_weights(tiny_model_dir):
    loss_fp32, norm_fp32, params_fp32 = _one_step(tiny_model_dir, use_packing=False)
    loss_bf16, norm_bf16, params_bf16 = _one_step(tiny_model_dir, use_packing=False, mixed_precision="bf16")
    assert loss_bf16 != loss_fp32  # the decoder really computed in bf16
    assert loss_bf16 == pytest.approx(loss_fp32, rel=2e-2)
    assert norm_bf16 == pytest.approx(norm_fp32, rel=5e-2)
    for name, tensor in params_bf16.items():
        assert tensor.dtype == torch.float32, name  # the optimizer updates fp32 master weights
        torch.testing.assert_close(tensor, params_fp32[name], rtol=0, atol=2e-3)
