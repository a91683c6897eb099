#!/usr/bin/env bash
# What runs on the H200 (device tool): the whole test suite on CUDA, then the benchmark.
# Usage: bash scripts/gpu-check.sh [quick|full|tests|bench|session|pending]   (logs under $OUT
# or ./out)
#   pending: what a session left unchecked on the GPU (nothing after session 20: the d=64
#   backward's bwd_ws variants' tests and their probe, ~2 min).
#   session: the README's benchmark table first (18 shapes, with FA4 when
#   `source .peers/fa4-b/activate.sh` ran first), then the GPU tests, then decode-bench.py
#   (DECODE=1), host-overhead.py (HOST_OVERHEAD=1) and hf-generate-bench.py (HF=1);
#   HOST_BREAKDOWN=0 leaves host-breakdown.py out. One device call within its 600 s
#   limit: ~230 s of benchmark, up to 300 s of tests (2026-11-29: 446 s without decode). It leaves
#   6 files under $OUT, 8 with DECODE=1 (a device call brings 8 back), 9 with both.
#   BENCH_WARMUP=100 gives the README's 100 ms warm-up per cell (default 10 ms).
set -uo pipefail
mode=${1:-quick}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cudnn', torch.backends.cudnn.version())" | tee -a "$out/gpu.txt"
status=0
run_tests() {
  # One pytest per file, all files at once (kernel compiles are CPU-bound and the machine
  # has 16 cores), each with its own time limit and verbose log: a file cut by its limit
  # still shows which of its tests passed or failed.
  : > "$out/tests.log"
  # FILE@I/N runs the I-th of N slices of FILE (conftest --shard): test_sm90_gpu.py alone
  # took 263 s of a 4.4-minute run (2026-11-29), compiling one kernel set after another;
  # three slices took up to 259 s of a 270 s limit (2026-11-30), four up to 264 s alone
  # (one was cut at 270 s beside the others, 2026-12-01 session 24), so five now.
  files=(${TEST_FILES:-tests/gpu/test_gpu.py tests/interpreted/test_attention.py \
      tests/interpreted/test_varlen.py tests/unit/test_api.py tests/unit/test_plans.py \
      tests/interpreted/test_kvcache.py tests/interpreted/test_portable_values.py \
      tests/gpu/test_sm90_gpu.py@0/5 tests/gpu/test_sm90_gpu.py@1/5 \
      tests/gpu/test_sm90_gpu.py@2/5 tests/gpu/test_sm90_gpu.py@3/5 \
      tests/gpu/test_sm90_gpu.py@4/5 \
      tests/gpu/test_sm90_bwd_gpu.py \
      tests/gpu/test_portable_tiles_gpu.py tests/unit/test_hf.py tests/unit/test_sm90_strided.py \
      tests/unit/test_packed.py tests/test_sm90_decode.py})
  pids=()
  logs=()
  for entry in "${files[@]}"; do
    f=${entry%@*}
    shard=()
    name=$(basename "$f" .py)
    if [ "$entry" != "$f" ]; then
      shard=(--shard "${entry#*@}")
      name="$name-$(echo "${entry#*@}" | tr / of)"
    fi
    log="$out/$name.log"
    logs+=("$log")
    # The backward's file compiles one kernel after another: with pytest-xdist (on the device
    # image) six workers take it from > 540 s (cut by the limit, 2026-11-30 session 19) to
    # about a minute (262 tests in 50 s with 14 workers alone on the machine). The other
    # files run in one process each (-n 0: tests/conftest.py gives a run without -n two
    # xdist workers).
    workers=()
    if python3 -c "import xdist" 2>/dev/null; then
      workers=(-n 0)
      [ "$f" = tests/gpu/test_sm90_bwd_gpu.py ] && workers=(-n 6)
    fi
    timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfs \
      ${PYTEST_K:+-k "$PYTEST_K"} "${shard[@]}" "${workers[@]}" "$f" > "$log" 2>&1 &
    pids+=($!)
  done
  for i in "${!files[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ "$rc" -ne 0 ] && status=1
    cat "${logs[$i]}" >> "$out/tests.log" && rm "${logs[$i]}"
    if [ "$rc" -eq 124 ]; then  # killed by timeout: its log has no pytest summary line
      echo "CUT: ${files[$i]} by its ${TEST_TIMEOUT:-540} s limit" | tee -a "$out/tests.log"
    else
      echo "${files[$i]}: $(tail -1 "$out/tests.log")"
    fi
  done
}
if [ "$mode" = pending ]; then
  # d=64's backward on bwd_ws (session 20: unmasked calls, causal ones from 2k rows): its
  # variants' GPU tests, then the probe against bwd.py's kernel (causal: the default below
  # 2k rows). ~2 min.
  TEST_FILES="tests/gpu/test_sm90_bwd_gpu.py" PYTEST_K="d64_split" \
    TEST_TIMEOUT=${TEST_TIMEOUT:-200} run_tests
  timeout 200 python3 scripts/sm90-bwd-probe.py --dims 64 --seqlens 512,2048,16384 \
    --no-peers --budget 190 \
    --variant "bwdpy:split_warpgroups=false,ws_dq_warp=false,dq_fragment=false,dq_swizzle=32" \
    --variant "ws:split_warpgroups=true,ws_dq_warp=true,dq_fragment=true" \
    > "$out/probe-d64.log" 2>&1
  tail -8 "$out/probe-d64.log"
elif [ "$mode" = session ]; then
  # The benchmark first: if the call runs out of time, the table is what matters most.
  timeout "${BENCH_TIMEOUT:-240}" python3 -m asymflash bench --hdim 64,128,256 \
    --seqlen 512,2k,16k --providers FA2,cuDNN,FA4,asymflash-sm90,asymflash-sm90-det \
    --warmup "${BENCH_WARMUP:-10}" --rep 40 --no-plots --out "$out/bench" > "$out/bench.log" 2>&1
  # (270 s cut test_sm90_gpu.py's fourth slice once, 2026-12-01 session 24)
  TEST_TIMEOUT=${TEST_TIMEOUT:-300} run_tests
  # Host time per piece of a 512-row call (the calls the benchmark finds host-bound).
  if [ "${HOST_BREAKDOWN:-1}" = 1 ]; then
    timeout 90 python3 scripts/host-breakdown.py > "$out/host-breakdown.log" 2>&1
    tail -24 "$out/host-breakdown.log"
  fi
  if [ "${HF:-0}" = 1 ]; then
    timeout 120 python3 scripts/hf-generate-bench.py > "$out/hf-generate.log" 2>&1
    grep -E "^(\||transformers)" "$out/hf-generate.log"
  fi
  if [ "${DECODE:-0}" = 1 ]; then
    timeout 150 python3 scripts/decode-bench.py --out "$out/decode" > "$out/decode.log" 2>&1
    grep -E "^\| (layout|paged|contiguous)" "$out/decode.log"
  fi
  if [ "${HOST_OVERHEAD:-0}" = 1 ]; then
    timeout 120 python3 scripts/host-overhead.py > "$out/host-overhead.log" 2>&1
    tail -16 "$out/host-overhead.log"
  fi
  grep -E "^\| (hdim|[0-9])" "$out/bench.log" | cut -d'|' -f2-4,8-
else
  [ "$mode" != bench ] && run_tests
  if [ "$mode" != tests ]; then
    bench_args=(--out "$out/bench")
    [ "$mode" = quick ] && bench_args+=(--quick)
    python3 -m asymflash bench "${bench_args[@]}" 2>&1 | tee "$out/bench.log"
  fi
fi
echo "== summary =="
grep -E "^(FAILED|ERROR|CUT)" "$out/tests.log" 2>/dev/null | head -20
grep -cE " PASSED" "$out/tests.log" 2>/dev/null | sed 's/^/passed: /'
exit $status
