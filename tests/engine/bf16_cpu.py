"""The skip mark of tests that compute in bf16 on the CPU: ``mixed_precision=bf16`` is refused on
a CPU without bf16 matrix instructions (:func:`tandem.device.check_bf16_compute`), so there those
tests cannot run (that refusal has its own test in ``test_cpu_bf16.py``)."""

import pytest

from tandem.device import cpu_bf16_instructions

needs_bf16_cpu = pytest.mark.skipif(
    cpu_bf16_instructions() is None, reason="this CPU has no bf16 matrix instructions (avx512_bf16, amx_bf16)"
)
