#!/bin/sh
# Make ready the one-shot GPU check (benchmarks/gpu_check.py) for a lent machine, which reaches no package
# registry: its image has PyTorch and transformers but not PuLP, which the planner's solvers import, nor HiGHS, which
# they solve with (CBC, bundled with PuLP, where it is missing). Run this here, in the repository root; it downloads
# the wheels of PuLP and highspy into .whl/, which git ignores.
# Then run on the device, with carry [".whl"] and a timeout that leaves time to rerun:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && set -o pipefail &&
#   python3 -m benchmarks.gpu_check --spec h200 --out $OUT/GPU.md 2>&1 | tee $OUT/log
set -e
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "pulp==3.3.2" "highspy==1.16.0"
ls -l .whl
