#!/usr/bin/env bash
# What runs on the H200 (device tool): the whole test suite on CUDA, then the benchmark.
# Usage: bash scripts/gpu-check.sh [quick|full|tests|bench|session|pending]   (logs under $OUT
# or ./out)
#   pending: what a session left unchecked on the GPU for the next (session 15's list: the
#   rewritten dQ-variant tests, the prepared variants and their probes, ~3-8 min; run in
#   session 16, benchmarks/results/2026-11-30-h200-session16/pending/).
#   session: the README's benchmark table first (18 shapes, with FA4 when
#   `source .peers/fa4-b/activate.sh` ran first), then the GPU tests, then decode-bench.py
#   (DECODE=1), host-overhead.py (HOST_OVERHEAD=1) and hf-generate-bench.py (HF=1);
#   HOST_BREAKDOWN=0 leaves host-breakdown.py out. One device call within its 600 s
#   limit: ~230 s of benchmark, ~270 s of tests (2026-11-29: 446 s without decode). It leaves
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
  # took 263 s of a 4.4-minute run (2026-11-29), compiling one kernel set after another.
  files=(${TEST_FILES:-tests/test_gpu.py tests/test_attention.py tests/test_varlen.py \
      tests/test_api.py tests/test_plans.py tests/test_kvcache.py tests/test_sm90_gpu.py@0/3 \
      tests/test_sm90_gpu.py@1/3 tests/test_sm90_gpu.py@2/3 tests/test_sm90_bwd_gpu.py \
      tests/test_portable_tiles_gpu.py tests/test_hf.py tests/test_sm90_strided.py \
      tests/test_packed.py tests/test_sm90_decode.py})
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
    timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfs \
      ${PYTEST_K:+-k "$PYTEST_K"} "${shard[@]}" "$f" > "$log" 2>&1 &
    pids+=($!)
  done
  for i in "${!files[@]}"; do
    wait "${pids[$i]}" || status=1
    cat "${logs[$i]}" >> "$out/tests.log" && rm "${logs[$i]}"
    echo "${files[$i]}: $(tail -1 "$out/tests.log")"
  done
}
if [ "$mode" = pending ]; then
  # what session 15 left unchecked on the GPU: the backward tests rewritten after its final
  # run (row-major dQ variants, now that d=128 defaults to fragment-order tiles), d=64's and
  # d=256's fragment-order variants, the forward's three-warpgroup ping-pong (prepared, off)
  # and d=128's dK behind dQ, with their probes (same process as the defaults). ~7-8 min.
  TEST_FILES="tests/test_sm90_bwd_gpu.py@0/3 tests/test_sm90_bwd_gpu.py@1/3 \
tests/test_sm90_bwd_gpu.py@2/3 tests/test_dq_fragments.py tests/test_sm90_gpu.py" \
    PYTEST_K="row-major or row_major or swizzle or fragment or 3wg-pingpong or dk-before or \
dk_after" \
    TEST_TIMEOUT=${TEST_TIMEOUT:-200} run_tests
  # the forward with three warpgroups taking turns (FwdConfig.pingpong with consumer_wgs=3,
  # FA4's d=64 shape; prepared, off)
  timeout 90 python3 scripts/sm90-probe.py --no-check --graph --cells 64:0:2048,64:0:16384 \
    --variant 64:wg3:consumer_wgs=3,persistent=true,q_buffers=1 \
    --variant 64:wg3pp:consumer_wgs=3,persistent=true,q_buffers=1,pingpong=true \
    > "$out/probe-fwd-3wg-pingpong.log" 2>&1
  tail -3 "$out/probe-fwd-3wg-pingpong.log"
  # fragment-order dQ at d=64 (bwd.py's kernel) and d=256 (bwd_wide), prepared, off
  timeout 150 python3 scripts/sm90-bwd-probe.py --no-peers --budget 110 --dims 64,256 \
    --seqlens 2048,16384 --variant frag:dq_fragment=true --variant base2:dq_fragment=false \
    --variant frag2:dq_fragment=true --variant det:deterministic=true \
    --variant detfrag:deterministic=true,dq_fragment=true > "$out/probe-fragment.log" 2>&1
  tail -14 "$out/probe-fragment.log"
  # d=128: dK issued behind dQ (BwdConfig.ws_dk_after_dq; prepared, off)
  timeout 120 python3 scripts/sm90-bwd-probe.py --no-peers --budget 90 --dims 128 \
    --seqlens 2048,16384 --variant dka:ws_dk_after_dq=true --variant base2:dq_fragment=true \
    --variant dka2:ws_dk_after_dq=true --variant det:deterministic=true \
    --variant detdka:deterministic=true,ws_dk_after_dq=true > "$out/probe-d128-dk-after.log" 2>&1
  tail -6 "$out/probe-d128-dk-after.log"
  # (then, in a call of its own: CASES="ours:bwd:128:0:16384" bash scripts/ncu-source.sh, and
  # scripts/ncu-source-top.py on its CSV: are the dQ stores' excess wavefronts gone?)
elif [ "$mode" = session ]; then
  # The benchmark first: if the call runs out of time, the table is what matters most.
  timeout "${BENCH_TIMEOUT:-240}" python3 -m asymflash bench --hdim 64,128,256 \
    --seqlen 512,2k,16k --providers FA2,cuDNN,FA4,asymflash-sm90,asymflash-sm90-det \
    --warmup "${BENCH_WARMUP:-10}" --rep 40 --no-plots --out "$out/bench" > "$out/bench.log" 2>&1
  TEST_TIMEOUT=${TEST_TIMEOUT:-270} run_tests
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
grep -E "^(FAILED|ERROR)" "$out/tests.log" 2>/dev/null | head -20
grep -cE " PASSED" "$out/tests.log" 2>/dev/null | sed 's/^/passed: /'
exit $status
