#!/usr/bin/env bash
# Before/after on the GPU: the benchmark grid for an older asymflash (its package unpacked
# under BASE, e.g. by `git archive REV asymflash | tar -x -C .baseline/REV`) and for this
# checkout, one process each, alternating per head dim so clock drift hits both alike; then
# scripts/bench-compare.py cell by cell. Logs and JSON under $OUT (or ./out).
#   bash scripts/bench-compare.sh .baseline/REV [extra bench args]
set -uo pipefail
base=$1; shift
out=${OUT:-out}
mkdir -p "$out"
here=$PWD
args=(--seqlen "${SEQLENS:-512,2k,16k}" --providers "${PROVIDER:-asymflash-sm90}"
      --warmup "${WARMUP:-100}" --rep "${REP:-40}" --no-plots "$@")
for h in ${HDIMS:-64 128 256}; do
  for side in old new; do
    root=$here; [ "$side" = old ] && root=$base
    (cd "$root" && PYTHONPATH=$root python3 -m asymflash bench --hdim "$h" "${args[@]}" \
      --out "$out/$side-$h") > "$out/$side-$h.log" 2>&1 || echo "bench $side d=$h: exit $?"
  done
done
for side in old new; do
  PYTHONPATH=$here python3 -m asymflash bench --merge "$out"/$side-*/ --out "$out/$side" \
    --no-plots > /dev/null 2>&1
done
python3 scripts/bench-compare.py "$out/old" "$out/new" --provider "${PROVIDER:-asymflash-sm90}" \
  | tee "$out/compare.md"
