"""One line about the machine a benchmark ran on: CPU model, cores, the vector extensions that
change kernel speed, and the GPU if any. Figures from different machines are not comparable."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def describe_machine() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and model in ("unknown CPU", platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    present = [f for f in VECTOR_FLAGS if f in flags] or ["none of " + "/".join(VECTOR_FLAGS)]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"machine: {model}; {os.cpu_count()} cores (torch uses {torch.get_num_threads()} threads); "
        f"cpu flags: {' '.join(present)}; {gpu}; torch {torch.__version__}"
    )


if __name__ == "__main__":
    print(describe_machine())
