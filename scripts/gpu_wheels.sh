#!/usr/bin/env bash
# Fetches, here, the wheels kvd needs on the device tool's GPU machine (Python 3.12, x86-64,
# torch already there, nothing downloadable there) into .whl/, at the versions this
# checkout's .venv runs, so the GPU check tests the code CI tests. ~13 MB.
#
#     bash scripts/gpu_wheels.sh      then carry .whl to: bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
packages="posix-ipc grpcio grpcio-health-checking grpcio-reflection protobuf xxhash uvloop prometheus-client"
rm -rf .whl && mkdir .whl
for name in $packages; do
    version=$($PY -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
    $PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$name==$version"
done
ls -1 .whl
