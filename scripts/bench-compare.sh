#!/usr/bin/env bash
# Before/after on the GPU: the benchmark grid for an older asymflash (its package unpacked
# under BASE, e.g. by `git archive REV asymflash | tar -x -C .baseline/REV`) and for this
# checkout, one process each per head dim, ROUNDS rounds (default 2) in alternating order so
# drift and warm-up hit both alike; then scripts/bench-compare.py cell by cell (each side's
# best round). Logs and JSON under $OUT (or ./out).
#   bash scripts/bench-compare.sh .baseline/REV [extra bench args]
set -uo pipefail
base=$1; shift
out=${OUT:-out}
mkdir -p "$out"
here=$PWD
args=(--seqlen "${SEQLENS:-512,2k,16k}" --providers "${PROVIDER:-asymflash-sm90}"
      --warmup "${WARMUP:-100}" --rep "${REP:-40}" --no-plots "$@")
rounds=${ROUNDS:-2}
for r in $(seq 1 "$rounds"); do
  order="old new"; [ $((r % 2)) -eq 0 ] && order="new old"
  for h in ${HDIMS:-64 128 256}; do
    for side in $order; do
      root=$here; [ "$side" = old ] && root=$base
      (cd "$root" && PYTHONPATH=$root python3 -m asymflash bench --hdim "$h" "${args[@]}" \
        --out "$out/$side-$h-r$r") > "$out/$side-$h-r$r.log" 2>&1 || echo "bench $side d=$h: exit $?"
    done
  done
done
python3 scripts/bench-compare.py --old "$out"/old-*/ --new "$out"/new-*/ \
  --provider "${PROVIDER:-asymflash-sm90}" | tee "$out/compare.md"
