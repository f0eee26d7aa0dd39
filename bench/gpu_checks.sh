#!/usr/bin/env bash
# Issue #18's GPU checks in one device call: the gpu test tier (every test marked gpu), then
# bench/gpu_step.py with the bf16 log-prob head (with --profile) and with the fp32 head. Logs and
# JSON go to $OUT.
#
#   here:   bash bench/gpu_wheels.sh
#   device: run(command="bash bench/gpu_checks.sh", carry=[".whl"], timeout_s=450)
#
# Each stage has its own time limit (7 minutes in all) so that a hang in one leaves the others
# their time, and a session's 15 device minutes keep room for a second try. On an H200 (2026-12-04)
# the tier took 30 s and the bf16-head step under 90 s; the fp32-head step with --profile did not
# finish in 150 s, so the profile now goes with the bf16 head, the setting the goals need.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed: run bench/gpu_wheels.sh here and carry .whl"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
    python3 -c "from tandem.kernels.cuda.varlen import installed_varlen_kernel as k; print('varlen kernel:', k())"
} 2>&1 | tee "$OUT/machine.txt"
timeout -k 10 120 python3 -m pytest -m gpu tests -q -p no:cacheprovider -rs --continue-on-collection-errors 2>&1 | tee "$OUT/gpu_tier.txt"
timeout -k 10 200 python3 bench/gpu_step.py --head-dtype bfloat16 --json "$OUT/step_bf16_head.json" \
    --profile /tmp/gpu-profile 2>&1 | tee "$OUT/step_bf16_head.txt"
timeout -k 10 100 python3 bench/gpu_step.py --json "$OUT/step_fp32_head.json" 2>&1 | tee "$OUT/step_fp32_head.txt"
