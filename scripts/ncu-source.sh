#!/usr/bin/env bash
# Nsight Compute warp-state sampling per SASS instruction (H200 diagnostics): which
# instructions our kernels' warps stall at, and why. One report per case, printed as the
# source page (SASS, CSV, gzipped) under $OUT; scripts/ncu-source-top.py reads them here.
#   CASES="ours:fwd:64:0:16384 ours:bwd:128:0:16384" bash scripts/ncu-source.sh
#   (impl:mode:d:causal:seqlen as scripts/ncu-compare.sh; impl ours or fa4)
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
source scripts/ncu-case.sh
cases=(${CASES:-ours:fwd:64:0:16384 ours:bwd:128:0:16384})
for c in "${cases[@]}"; do
  read_ncu_case "$c"
  name="src-$impl-$mode-d$d-c$causal-$seqlen"
  rep=/tmp/$name
  timeout 200 ncu --clock-control none --section WarpStateStats --section SourceCounters \
    --import-source no -k "regex:$pat" -s "$skip" -c 1 -f -o "$rep" \
    python3 scripts/profile-target.py "$impl" "$mode" "$d" "$causal" "$seqlen" > "$out/$name.log" 2>&1
  ncu -i "$rep.ncu-rep" --page source --csv --print-source sass 2>> "$out/$name.log" \
    | gzip > "$out/$name.csv.gz"
  echo "== $c: $(zcat "$out/$name.csv.gz" | wc -l) lines; $(tail -1 "$out/$name.log")"
done
