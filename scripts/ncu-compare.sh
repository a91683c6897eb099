#!/usr/bin/env bash
# Nsight Compute beside FA4 (H200 diagnostics): where the forward's and the backward's cycles
# go in our kernels and in FA4's, same shapes (scripts/profile-target.py). Run after
# `source .peers/fa4-b/activate.sh`; logs under $OUT, a short table last.
#   CASES="ours:fwd:64:0:16384 ..." bash scripts/ncu-compare.sh   (impl:mode:d:causal:seqlen)
#   impl: ours or fa4
#   STALLS=1: per-reason stall cycles and pipe utilisation (raw metrics) instead of sections
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source scripts/ncu-case.sh
sections=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats
          --section SchedulerStats --section InstructionStats --section Occupancy)
if [ "${STALLS:-0}" = 1 ]; then
  sections=(--metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,\
regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,\
regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,\
gpu__time_duration.sum,smsp__inst_executed.sum")
fi
# FA4's kernel names (CuTe DSL classes), to pick its main kernels below (NAMES=0: skip).
[ "${NAMES:-1}" = 1 ] && python3 - > "$out/fa4-kernel-names.txt" 2>&1 <<'PY'
import torch
from torch.profiler import profile, ProfilerActivity
from flash_attn.cute import flash_attn_func as fa4
q, k, v = (torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
o = fa4(q, k, v); o = o[0] if isinstance(o, tuple) else o; o.sum().backward()
with profile(activities=[ProfilerActivity.CUDA]) as p:
    o = fa4(q, k, v); o = o[0] if isinstance(o, tuple) else o; o.sum().backward()
    torch.cuda.synchronize()
for e in p.key_averages():
    print(e.key[:160])
PY
cases=(${CASES:-ours:fwd:64:0:16384 fa4:fwd:64:0:16384 ours:fwd:128:0:16384 fa4:fwd:128:0:16384
       ours:bwd:128:0:16384 fa4:bwd:128:0:16384})
for c in "${cases[@]}"; do
  read_ncu_case "$c"
  log="$out/ncu-$impl-$mode-d$d-c$causal-$seqlen${STALLS:+-stalls}.txt"
  timeout 150 ncu --clock-control none "${sections[@]}" -k "regex:$pat" -s "$skip" -c 1 \
    python3 scripts/profile-target.py "$impl" "$mode" "$d" "$causal" "$seqlen" > "$log" 2>&1
  echo "== $c: $(grep -m1 -oE '^  [A-Za-z_].*\(' "$log" | cut -c1-70)"
  if [ "${STALLS:-0}" = 1 ]; then  # metric, unit, value: the larger stall reasons and pipes
    awk '/stalled|pipe_|duration/ && $NF+0 > 0.3 {print $1, $NF}' "$log" | sed 's/\.avg\.pct.*active//; s/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//'
    continue
  fi
  grep -E "^    (Duration|Compute \(SM\) Throughput|Executed Ipc Active|Issue Slots Busy|\
Warp Cycles Per Issued Instruction|No Eligible|Registers Per Thread|Achieved Occupancy)" "$log" \
    | sed 's/  */ /g'
done
