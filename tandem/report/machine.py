"""What a run ran on and with: the machine (CPU model, cores, the vector extensions that change
kernel speed, memory, GPUs) and the versions of the packages that shape its numbers.

Cheap and side-effect free: GPUs are read with ``nvidia-smi`` rather than by initialising CUDA in
the calling process (the controller must not take GPU memory from its workers).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from pathlib import Path

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
PACKAGES = ("tandem-rl", "torch", "transformers", "tensordict", "tokenizers", "ray", "vllm", "peft", "plotly")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`VECTOR_FLAGS` it has (Linux; elsewhere no flags)."""
    model, flags = platform.processor() or "unknown CPU", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    return model, [f for f in VECTOR_FLAGS if f in flags]


def gpu_names() -> list[str]:
    """One name per visible NVIDIA GPU (from ``nvidia-smi``), or an empty list."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine_facts() -> dict[str, object]:
    """``{"host", "os", "python", "cpu", "cores", "cpu_flags", "memory_gib", "gpus"}``."""
    model, flags = cpu_model_and_flags()
    memory = None
    with_pages = ("SC_PAGE_SIZE", "SC_PHYS_PAGES")
    if all(name in os.sysconf_names for name in with_pages):
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {
        "host": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_flags": flags,
        "memory_gib": memory,
        "gpus": gpu_names(),
    }


def package_versions() -> dict[str, str]:
    """Installed versions of :data:`PACKAGES` (absent ones left out), without importing them."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
