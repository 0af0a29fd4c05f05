#!/usr/bin/env bash
# Every GPU check of the attention kernels in one call: parity tests, then both benchmarks.
# Usage (on the GPU machine, plyx installed): OUT=/some/dir bash packages/kernel/bench/attention/run_gpu.sh
# Writes $OUT/attention-tests.txt, $OUT/attention-flash.json, $OUT/attention-paged.json and the merged
# $OUT/attention-<device>-<date>.{json,md} (copy those to packages/kernel/bench/results/).
set -u
OUT=${OUT:-/tmp/attention-bench}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../../.." && pwd)
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader || true
timeout "${TEST_TIMEOUT:-180}" python3 -m pytest -q -p no:cacheprovider -x \
    "$ROOT/packages/kernel/tests/attention/test_attention_gpu.py" 2>&1 | tail -n 30 | tee "$OUT/attention-tests.txt"
timeout "${FLASH_TIMEOUT:-300}" python3 "$HERE/bench_attention.py" --out "$OUT/attention-flash.json" 2>&1 | tail -n 40
timeout "${PAGED_TIMEOUT:-90}" python3 "$HERE/bench_paged_attention.py" ${PAGED_ARGS:-} --out "$OUT/attention-paged.json" 2>&1 | tail -n 40
DEVICE=$(python3 -c "import torch,re; print(re.sub('[^a-z0-9]+','-',torch.cuda.get_device_name().lower()).strip('-'))")
DATE=$(date -u +%Y-%m-%d)
python3 "$HERE/report.py" "$OUT/attention-flash.json" "$OUT/attention-paged.json" --tests "$OUT/attention-tests.txt" \
    --out-json "$OUT/attention-$DEVICE-$DATE.json" --out-md "$OUT/attention-$DEVICE-$DATE.md" > /dev/null
cat "$OUT/attention-$DEVICE-$DATE.md"
