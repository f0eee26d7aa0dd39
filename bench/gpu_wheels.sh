#!/usr/bin/env bash
# Wheels of tandem's dependencies that the lent GPU machines' image lacks (it has torch,
# transformers, numpy, pyarrow, rich, pyyaml, cloudpickle and pytest), for Python 3.12, into
# .whl/ (in .gitignore). Run once here; the device call carries .whl (see bench/gpu_checks.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl tensordict==0.15.3 pyvers==0.2.3 hydra-core==1.3.8 omegaconf==2.3.1 plotly==7.1.0 narwhals==2.29.0
python3 -m pip wheel -q --no-deps "antlr4-python3-runtime==4.9.3" -w .whl  # published as a source archive only
ls .whl
