#!/usr/bin/env bash
# The README's H200 table: `python -m asymflash bench` over the default grid, one process per
# head dim (each writes its results.json after every shape, so a time limit loses at most one
# shape), merged afterwards with `python -m asymflash bench --merge`. FA4 joins when
# flash_attn.cute is importable (.peers/fa4-b/activate.sh, see README).
# Usage: bash scripts/bench-h200.sh        (results under $OUT/bench or ./out/bench)
set -uo pipefail
out=${OUT:-out}/bench
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
for h in ${HDIMS:-128 64 256}; do
  timeout "${PER_HDIM_TIMEOUT:-175}" python3 -m asymflash bench --hdim "$h" \
    --flex-seqlens "${FLEX_SEQLENS:-16k}" ${BENCH_ARGS:---warmup 15 --rep 60} --no-plots \
    --out "$out/h$h" > "$out/h$h.log" 2>&1
  echo "hdim $h: exit $?"
  rm -f "$out/h$h/results.md"
done
grep -h "vs " "$out"/h*.log | tail -40
