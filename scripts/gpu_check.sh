#!/usr/bin/env bash
# kvd's CUDA-only checks and GPU benchmarks in one run, on a machine with an NVIDIA GPU
# (made for the device tool's H200: its python3 holds torch, transformers, pytest and
# hypothesis; the rest comes as wheels from scripts/gpu_wheels.sh, carried as .whl).
#
#     bash scripts/gpu_check.sh          every log and summary.txt land in $OUT (or /tmp/kvd-gpu)
#
# Steps: the tests marked cuda (registered shared memory → GPU loads on a side stream, the
# vLLM connector's CUDA copies, GPU prefill vs transformers, the demo's engines on CUDA),
# the demo itself on CUDA, and
# the GPU benchmarks (host→device GB/s from shared-memory pages vs pinned memory; suffix-only
# prefill speed-up). Each step is capped at 5 minutes; record what it prints in bench/RESULTS.md.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kvd-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "installing the carried wheels failed"; exit 1; }
    export PYTHONPATH=/tmp/site:$PWD
fi

step() {
    local name=$1; shift
    echo "== $name: $*"
    timeout 300 "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc" >>"$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

nvidia-smi -L | tee "$out/summary.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$out/summary.txt"
step cuda_tests python3 -m pytest -q -p no:cacheprovider -m cuda -rs tests/
step demo_cuda python3 -m gpu_worker.demo --device cuda
step bench_decode_loads python3 bench/bench_decode_loads.py --device cuda
step bench_prefill python3 bench/bench_prefill.py --device cuda --prefix-tokens 32768 --suffix-tokens 512
echo "== summary"
cat "$out/summary.txt"
