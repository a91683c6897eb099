#!/usr/bin/env bash
# The sm90 Gluon kernels' compile matrix over Triton releases (CPU only, no GPU needed).
#
# For each version (default: 3.6.0 3.7.1 3.8.0 3.9.0) this puts that triton in a prefix of
# its own (pip install --no-deps --target, cached; the venv's triton, the one torch pins,
# stays as it is; the venv's own version is used as installed), and with the prefix first on
# PYTHONPATH builds the default forward and backward kernels at head dims 64, 128 and 256
# for sm_90a:
#   - their compile tests: HGMMA present, setmaxnreg budgets, shared memory, TMA reduce and
#     stores, registers <= 255; spill budgets exact on 3.6 (where they were measured), an
#     overrun skipped with its numbers on other releases (tests/sass_report.py: Budgets);
#   - a table of registers and local-memory (spill) instructions per build and version
#     (scripts/sass-digest.py), to compare against 3.6.
#
# Usage, from anywhere in the checkout, with the venv's python on PATH (or PYTHON=...):
#     scripts/triton-matrix.sh                 # all four versions
#     scripts/triton-matrix.sh 3.8.0 3.9.0     # some
# Environment: TRITON_MATRIX_CACHE (default ~/.cache/asymflash/triton-matrix) holds the
# prefixes (~0.9 GB each) and each version's kernel cache; TRITON_MATRIX_JOBS (default 2)
# test processes. Exit status 1 if any version fails to build or a check fails.
#
# Time on the 2-core CI machine (cold kernel caches, wheels already downloaded): see
# docs/triton-versions.md. The kernel caches make a rerun of unchanged sources fast; a
# changed kernel source misses them (Triton keys on the source), so a rerun is still a check.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python}
cache=${TRITON_MATRIX_CACHE:-$HOME/.cache/asymflash/triton-matrix}
jobs=${TRITON_MATRIX_JOBS:-2}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.6.0 3.7.1 3.8.0 3.9.0)
tests=(
  "tests/compile/test_sm90_compile.py::test_compiles_with_hgmma_and_no_spills[head_dim=64]"
  "tests/compile/test_sm90_compile.py::test_compiles_with_hgmma_and_no_spills[head_dim=128]"
  "tests/compile/test_sm90_compile.py::test_compiles_with_hgmma_and_no_spills[head_dim=256]"
  "tests/compile/test_sm90_bwd_compile.py::test_bwd_compiles_with_hgmma_and_budgets[head_dim=64-8]"
  "tests/compile/test_sm90_bwd_compile.py::test_bwd_compiles_with_hgmma_and_budgets[head_dim=128-48]"
  "tests/compile/test_sm90_bwd_compile.py::test_bwd_compiles_with_hgmma_and_budgets[head_dim=256-0]"
)
builds=fwd-d64,fwd-d128,fwd-d256,bwd-d64,bwd-d128,bwd-d256-wide
venv_triton=$("$py" -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)
report=$(mktemp -d)
trap 'rm -rf "$report"' EXIT
status=0
cd "$root"
for v in "${versions[@]}"; do
  start=$(date +%s)
  if [ "$v" = "$venv_triton" ]; then
    path=$root  # the venv's own triton, and Triton's default kernel cache (CI's test run's)
    kcache=${TRITON_CACHE_DIR:-}
  else
    prefix=$cache/triton-$v
    if [ ! -f "$prefix/.complete" ]; then
      rm -rf "$prefix"
      "$py" -m pip install -q --no-deps --target "$prefix" "triton==$v"
      touch "$prefix/.complete"
    fi
    path=$prefix:$root
    kcache=$cache/kernels-$v
  fi
  run() { env PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" ${kcache:+TRITON_CACHE_DIR=$kcache} \
    TRITON_DEFAULT_FP_FUSION=1 "$@"; }
  got=$(run "$py" -c 'import triton; print(triton.__version__)')
  if [ "$got" != "$v" ]; then
    echo "triton-matrix: asked for triton $v, got $got"; status=1; continue
  fi
  echo "== triton $v"
  if ! run "$py" -m pytest -q -n "$jobs" -p no:cacheprovider -rs --no-header "${tests[@]}"; then
    status=1
  fi
  if ! run "$py" scripts/sass-digest.py -j "$jobs" --names "$builds" | tee "$report/$v"; then
    status=1
  fi
  echo "triton $v: $(( $(date +%s) - start )) s"
done
# registers / local-memory instructions of each build, one column per version
"$py" - "$report" "${versions[@]}" <<'EOF'
import re, sys
from pathlib import Path
folder, versions = Path(sys.argv[1]), sys.argv[2:]
rows = {}
for v in versions:
    f = folder / v
    for line in (f.read_text().splitlines() if f.exists() else []):
        m = re.match(r"(\S+)\s+\S+\s+ins=\s*\d+\s+regs=\s*(\d+)\s+stl=\s*(\d+)\s+ldl=\s*(\d+)", line)
        cell = f"{m[2]} / {int(m[3]) + int(m[4])}" if m else "ERROR"
        rows.setdefault(line.split()[0], {})[v] = cell
print("\nregisters / local-memory instructions (sm_90a)")
print(f"{'build':16s}" + "".join(f"{v:>12s}" for v in versions))
for name, cells in rows.items():
    print(f"{name:16s}" + "".join(f"{cells.get(v, '-'):>12s}" for v in versions))
EOF
exit $status
