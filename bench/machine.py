"""One line about the machine a benchmark ran on: CPU model, cores, the vector extensions that
change kernel speed, and the GPU if any. Figures from different machines are not comparable."""

from __future__ import annotations

import os

import torch

from tandem.report.machine import VECTOR_FLAGS, cpu_model_and_flags


def describe_machine() -> str:
    model, flags = cpu_model_and_flags()
    present = flags or ["none of " + "/".join(VECTOR_FLAGS)]
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (
        f"machine: {model}; {os.cpu_count()} cores (torch uses {torch.get_num_threads()} threads); "
        f"cpu flags: {' '.join(present)}; {gpu}; torch {torch.__version__}"
    )


if __name__ == "__main__":
    print(describe_machine())
