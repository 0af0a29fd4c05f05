#!/usr/bin/env bash
# One device call: GPU parity tests of plyx-kernel (attention excluded: its own session), then the benchmarks.
# Expects plyx-specs and plyx-kernel (and liger-kernel) installed on PYTHONPATH, torch + triton present.
# Usage: bash packages/kernel/bench/gpu_session.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_BUDGET_S]
set -uo pipefail
out=${1:?output dir}; test_timeout=${2:-200}; bench_budget=${3:-230}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/device.txt"
cd "$(dirname "$0")/../tests/.."
# 8 workers: the time goes into compiling Triton kernels, which is CPU work
timeout "$test_timeout" python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short --durations=10 tests \
    --ignore=tests/attention 2>&1 | tee "$out/gpu-tests.log" | grep -E "^(FAILED|ERROR)|passed|failed" | tail -30
echo "tests exit: ${PIPESTATUS[0]}"
timeout $((bench_budget + 90)) python3 bench/run.py --out "$out" --budget-s "$bench_budget" 2>&1 | tee "$out/bench.log" | tail -60
echo "bench exit: ${PIPESTATUS[0]}"
