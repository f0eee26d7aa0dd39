"""Profile one phase of a benchmark: where its time goes, and how much of it the GPU is busy.

``profile_phase(run, device, label, out_dir)`` runs ``run()`` once under ``torch.profiler``
and prints the operators that took the most device time (CPU time on the CPU) and, on CUDA,
the **device-busy fraction**: the kernels' summed time over the wall time. A decode step that
is bound by kernel launches and Python shows a low busy fraction (the GPU idles between small
kernels); one bound by memory bandwidth shows a high one. The Chrome trace goes to
``out_dir/<label>.json`` (open it in ``chrome://tracing`` or Perfetto).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile


def _self_device_us(event) -> float:
    """An operator's own device time in µs (the attribute's name changed across PyTorch releases)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_phase(run: Callable[[], object], device: torch.device, label: str, out_dir: str) -> dict:
    """Run ``run()`` under the profiler; print its top operators; return the phase's figures."""
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    if on_gpu:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        run()
        if on_gpu:
            torch.cuda.synchronize(device)
    wall_us = (time.perf_counter() - start) * 1e6
    averages = profiler.key_averages()
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    print(f"--- profile of {label} (wall {wall_us / 1e3:.1f} ms) ---")
    print(averages.table(sort_by=sort_by, row_limit=15))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(Path(out_dir) / f"{label}.json"))
    figures = {f"{label}_profile_wall_ms": wall_us / 1e3}
    if on_gpu:
        # Kernels only: a CPU operator's row repeats the time of the kernels it launched.
        busy_us = sum(_self_device_us(event) for event in averages if event.device_type == DeviceType.CUDA)
        figures[f"{label}_device_busy_fraction"] = busy_us / wall_us
        figures[f"{label}_kernel_launches"] = sum(
            event.count for event in averages if event.key in ("cudaLaunchKernel", "cuLaunchKernel")
        )
    return figures
