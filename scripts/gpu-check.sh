#!/usr/bin/env bash
# What runs on the H200 (device tool): the whole test suite on CUDA, then the benchmark.
# Usage: bash scripts/gpu-check.sh [quick|full|tests|bench]   (logs under $OUT or ./out)
set -uo pipefail
mode=${1:-quick}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cudnn', torch.backends.cudnn.version())" | tee -a "$out/gpu.txt"
status=0
if [ "$mode" != bench ]; then
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -p no:cacheprovider --durations=15 -rfs tests \
    2>&1 | tee "$out/tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$mode" != tests ]; then
  bench_args=(--out "$out/bench")
  [ "$mode" = quick ] && bench_args+=(--quick)
  python3 -m asymflash bench "${bench_args[@]}" 2>&1 | tee "$out/bench.log"
fi
echo "== summary =="
grep -E "passed|failed|error" "$out/tests.log" 2>/dev/null | tail -1
exit $status
