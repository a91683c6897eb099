#!/usr/bin/env bash
# What runs on the GPU machine (the device tool), from the checkout's root. Logs under $OUT
# (or ./out); a short table last; exit status 1 when a test fails, a sanitizer finds an
# error, or the benchmark finds a wrong cell.
#
#   bash scripts/gpu-check.sh tests      the GPU test files, one pytest each, all at once
#   bash scripts/gpu-check.sh sanitize   compute-sanitizer memcheck and racecheck on
#                                        scripts/sanitize.py, racecheck on the minimal
#                                        mbarrier hand-off (scripts/racecheck-handoff.py)
#   bash scripts/gpu-check.sh bench      the README's grid (FA4 joins when flash_attn.cute
#                                        imports: source .peers/fa4-b/activate.sh first)
#   bash scripts/gpu-check.sh compare DIR   before/after grid against the package in DIR
#                                        (scripts/bench-compare.sh)
#   bash scripts/gpu-check.sh first-call time to first result, cold and cached, beside FA4
#                                        (scripts/first-call.py, d=64/128/256 causal)
#   bash scripts/gpu-check.sh models     the models suite (FA4 joins as for bench; MODELS_CASE
#                                        picks cases, as --case). All of it takes longer than one
#                                        10-minute device call (2026-12-05: two cases and part of
#                                        the 128k one in 400 s): run it in groups, e.g.
#                                        MODELS_CASE=varlen,mla (2 min on an H100) / long
#                                        (alone: 16 of its 20 cells took 327 s) /
#                                        vit,train,swa,softcap,hybrid,decode (4.5 min),
#                                        then `bench --merge` the outs
#   bash scripts/gpu-check.sh fp8        the fp8 forward grid (d 64/128) beside bf16 and cuDNN fp8
#                                        (cuDNN's column needs nvidia-cudnn-frontend, not on the
#                                        machine: carry `.whl` holding its 1.16.0 cp312 wheel,
#                                        which needs no other package, and begin the command with
#                                        the device README's pip install of .whl)
#   bash scripts/gpu-check.sh full       tests, sanitize, bench, first-call
#
# Knobs: TEST_FILES, TEST_PART (I/N: every N-th entry of the file list from the I-th, 1-based:
# on an 80 GB H100 the whole list took over 580 s ten files at a time, so run it as 1/2 and
# 2/2 in two device calls), TEST_TIMEOUT (s per file, default 300), TEST_JOBS (files at a
# time: all on a card of >= 120 GB, else 10), TIMING_TIMEOUT (the tests marked timing or
# alone, run by themselves after the rest: default 300), PYTEST_K, BENCH_WARMUP (ms per cell, default 100), BENCH_TIMEOUT
# (default 300), SANITIZE_TIMEOUT (default 240 per tool).
set -uo pipefail
mode=${1:-tests}
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cudnn', torch.backends.cudnn.version())" | tee -a "$out/gpu.txt"
status=0
summary=()

run_tests() {
  # One pytest per file, all at once (kernel compiles are CPU-bound; the machine has 16
  # cores), each with its own time limit and log, so a file cut by its limit still shows
  # which tests passed. FILE@I/N runs the I-th of N slices of FILE (conftest's --shard): the
  # forward's GPU file compiles one kernel set after another and needs seven slices.
  local files=(${TEST_FILES:-tests/gpu/test_gpu.py tests/gpu/test_sm90_gpu.py@0/7 \
      tests/gpu/test_sm90_gpu.py@1/7 tests/gpu/test_sm90_gpu.py@2/7 \
      tests/gpu/test_sm90_gpu.py@3/7 tests/gpu/test_sm90_gpu.py@4/7 \
      tests/gpu/test_sm90_gpu.py@5/7 tests/gpu/test_sm90_gpu.py@6/7 \
      tests/gpu/test_sm90_bwd_gpu.py tests/gpu/test_portable_tiles_gpu.py \
      tests/interpreted/test_attention.py tests/interpreted/test_varlen.py \
      tests/interpreted/test_kvcache.py tests/interpreted/test_portable_values.py \
      tests/unit/test_api.py tests/unit/test_plans.py tests/unit/test_hf.py \
      tests/unit/test_sm90_strided.py tests/unit/test_packed.py tests/unit/test_core_exp2.py \
      tests/interpreted/test_serving_varlen.py tests/unit/test_cache_checks.py \
      tests/gpu/test_decode_no_sync_gpu.py tests/gpu/test_models_suite_gpu.py \
      tests/gpu/test_warm_gpu.py tests/gpu/test_torch_sdpa_gpu.py tests/gpu/test_fp8_gpu.py \
      tests/unit/test_fp8.py tests/interpreted/test_fp8_portable.py tests/gpu/test_torch_cp_gpu.py \
      tests/gpu/test_flex_gpu.py@0/2 tests/gpu/test_flex_gpu.py@1/2 tests/gpu/test_cp_gpu.py})
  if [ -n "${TEST_PART:-}" ]; then
    local part=${TEST_PART%/*} parts=${TEST_PART#*/} i picked=()
    for i in "${!files[@]}"; do
      [ $(( i % parts )) -eq $(( part - 1 )) ] && picked+=("${files[$i]}")
    done
    files=("${picked[@]}")
  fi
  local pids=() logs=() entry f name shard workers
  : > "$out/tests.log"
  # All at once needs an H200's 141 GB; on a smaller card (an 80 GB H100: ~100 tests ran out
  # of memory that way, 2026-12-05) at most TEST_JOBS files run at a time.
  local mib jobs
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null \
    | head -1)
  jobs=${TEST_JOBS:-$([ "${mib:-0}" -ge 120000 ] && echo ${#files[@]} || echo 10)}
  for entry in "${files[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
    f=${entry%@*}
    shard=()
    name=$(basename "$f" .py)
    if [ "$entry" != "$f" ]; then
      shard=(--shard "${entry#*@}")
      name="$name-$(echo "${entry#*@}" | tr / of)"
    fi
    logs+=("$out/$name.log")
    # The backward's file compiles one kernel after another: six xdist workers take it from
    # over 540 s to about a minute. The others run in one process each.
    workers=(-n 0)
    [ "$f" = tests/gpu/test_sm90_bwd_gpu.py ] && workers=(-n 6)
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfsx \
      -m "not timing and not alone" ${PYTEST_K:+-k "$PYTEST_K"} "${shard[@]}" \
      "${workers[@]}" "$f" \
      > "${logs[-1]}" 2>&1 &
    pids+=($!)
  done
  local i rc
  for i in "${!files[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ "$rc" -ne 0 ] && status=1
    cat "${logs[$i]}" >> "$out/tests.log" && rm "${logs[$i]}"
    if [ "$rc" -eq 124 ]; then  # killed by timeout: its log has no pytest summary line
      echo "CUT: ${files[$i]} by its ${TEST_TIMEOUT:-300} s limit" | tee -a "$out/tests.log"
    fi
  done
  # Tests that time kernels (marker `timing`) or need most of the GPU's memory (`alone`)
  # run by themselves, after the rest: beside a dozen other files on the same GPU the
  # timings measured the neighbours, and the big ones ran out of memory.
  local unique=($(printf '%s\n' "${files[@]%@*}" | sort -u))
  timeout "${TIMING_TIMEOUT:-300}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfsx \
    -m "timing or alone" ${PYTEST_K:+-k "$PYTEST_K"} "${unique[@]}" > "$out/timing.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && status=1  # 5: no timing test among the files
  cat "$out/timing.log" >> "$out/tests.log" && rm "$out/timing.log"
  [ "$rc" -eq 124 ] && echo "CUT: the timing tests by their ${TIMING_TIMEOUT:-300} s limit" \
    | tee -a "$out/tests.log"
  local passed failed
  passed=$(grep -cE " PASSED" "$out/tests.log")
  failed=$(grep -cE "^(FAILED|ERROR|CUT)" "$out/tests.log")
  grep -E "^(FAILED|ERROR|CUT)" "$out/tests.log" | head -20
  summary+=("tests: $passed passed, $failed failed or cut")
}

run_sanitize() {
  # Kernels compile into Triton's cache in a plain run first; under the tool they only run.
  python3 scripts/sanitize.py > "$out/sanitize-plain.log" 2>&1 || status=1
  tail -1 "$out/sanitize-plain.log"
  local tool log errors rc
  for tool in memcheck racecheck; do
    log="$out/sanitize-$tool.log"
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --print-limit 40 \
      python3 scripts/sanitize.py > "$log" 2>&1
    rc=$?
    errors=$(grep -E "^========= (ERROR SUMMARY|RACECHECK SUMMARY)" "$log" | tail -2 | tr '\n' ' ')
    summary+=("$tool on sanitize.py (exit $rc): ${errors:-no summary, see $log}")
    [ "$tool" = memcheck ] && ! grep -q "ERROR SUMMARY: 0 errors" "$log" && status=1
  done
  log="$out/racecheck-handoff.log"
  timeout 120 compute-sanitizer --tool racecheck --print-limit 10 \
    python3 scripts/racecheck-handoff.py > "$log" 2>&1
  summary+=("racecheck on the minimal mbarrier hand-off: $(grep -E '^handoff|RACECHECK SUMMARY' \
    "$log" | tr '\n' ' ')")
}

bench_step() {
  # bench_step NAME LIMIT ARGS...: `python -m asymflash bench ARGS --no-plots --out $out/NAME`
  # under a time limit, log in $out/NAME.log; prints its table rows, counts the WRONG cells
  # (table rows only, not the legend); exit 1: a wrong asymflash cell, 124: cut by the limit
  local name=$1 limit=$2 rc
  shift 2
  timeout "$limit" python3 -m asymflash bench "$@" --no-plots --out "$out/$name" \
    > "$out/$name.log" 2>&1
  rc=$?
  [ "$rc" -ne 0 ] && status=1
  grep -E "^\| " "$out/$name.log" | tail -60
  summary+=("$name: exit $rc ($(grep -cE '^\|.*WRONG' "$out/$name.log") WRONG cells)")
}

run_bench() {
  bench_step bench "${BENCH_TIMEOUT:-300}" --hdim 64,128,256 --seqlen 512,2k,16k \
    --providers FA2,cuDNN,FA4,asymflash-sm90,asymflash-sm90-det \
    --warmup "${BENCH_WARMUP:-100}" --rep 40
}

run_models() {
  bench_step models "${MODELS_TIMEOUT:-540}" --suite models ${MODELS_CASE:+--case "$MODELS_CASE"}
}

run_fp8() {
  bench_step fp8 "${BENCH_TIMEOUT:-300}" --dtype fp8 --mode fwd --hdim 64,128 \
    --seqlen 1k,4k,16k
}

run_first_call() {
  local d rc=0
  for d in 64 128 256; do
    timeout 600 python3 scripts/first-call.py --head-dim "$d" --causal --out "$out/first-call-d$d" \
      > "$out/first-call-d$d.log" 2>&1 || rc=$?
    tail -6 "$out/first-call-d$d.log"
  done
  summary+=("first-call: exit $rc")
}

case "$mode" in
  tests) run_tests ;;
  first-call) run_first_call ;;
  sanitize) run_sanitize ;;
  models) run_models ;;
  fp8) run_fp8 ;;
  bench) run_bench ;;
  compare)
    bash scripts/bench-compare.sh "${2:?compare needs the baseline package directory}" \
      || status=1
    summary+=("compare: $(tail -1 "$out/compare.md")") ;;
  full) run_tests; run_sanitize; run_bench; run_first_call ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
echo "== summary =="
printf '%s\n' "${summary[@]}"
exit $status
