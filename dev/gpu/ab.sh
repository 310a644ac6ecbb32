#!/usr/bin/env bash
# A/B of a kernel change on the GPU machine, in one device call: builds the tree as committed (HEAD, from
# .gpu/base.tar) and the working tree side by side, runs the selected GPU tests and compute-sanitizer
# (memcheck, racecheck, synccheck) on the working tree, then the benchmark in alternating processes, and
# prints the kernel times of one token_max fp8 call under ncu for both.
#
# Here:   dev/gpu/stage_deps.sh && git archive HEAD -o .gpu/base.tar   (then apply the change to the tree)
# There:  OUT=... dev/gpu/ab.sh   (run with carry [".gpu"])
# Knobs: FILTER (gtest filter), SAN (sanitised tests), ROUNDS (benchmark rounds), BENCH (script and
# arguments), SHOW (the benchmark lines printed, grep -E), NCU=0 to skip ncu. Logs go to $OUT; the figures to stdout.
set -u -o pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
FILTER="${FILTER:-TokenMax*:Pooled*:Lightning*:SelectorPrep*:SelectorsGpu*}"
SAN="${SAN:-TokenMaxGpu.SanitizerSmall:PooledGpu.SanitizerSmall}"
ROUNDS="${ROUNDS:-1 2 3}"
BENCH="${BENCH:-bench/gpu/bench_selectors.py}"
SHOW="${SHOW:-^selector|us}"  # benchmark output lines printed (grep -E)
mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
bld() {  # source dir, build dir, tag
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSE_ATTN_CUDA=ON -DSPARSE_ATTN_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_PREFIX_PATH="$ROOT/.gpu/usr" > "$OUT/cfg_$3.log" 2>&1 &&
    cmake --build "$2" -j "$(nproc)" --target sparse_attn sparse_attn_gpu_tests _ext > "$OUT/build_$3.log" 2>&1
  local rc=$?
  mkdir -p "$2/py/sparse_attn" && cp "$1"/python/sparse_attn/*.py "$2/py/sparse_attn/" &&
    cp "$2"/python/_ext*.so "$2/py/sparse_attn/" 2>/dev/null
  return $rc
}
BASE=/tmp/ab-base
rm -rf "$BASE" && mkdir -p "$BASE" && tar -xf "$ROOT/.gpu/base.tar" -C "$BASE"
bld "$BASE" "$BASE/build" base & PB=$!
bld "$ROOT" "$ROOT/build-ab" new & PN=$!
wait $PB; RB=$?; wait $PN; RN=$?
el "builds: base rc=$RB, new rc=$RN"
[ "$RB" = 0 ] && [ "$RN" = 0 ] || { grep -hE "error|FAILED" "$OUT"/build_*.log | head -30; exit 1; }
TB="$ROOT/build-ab/tests/sparse_attn_gpu_tests"
timeout 400 "$TB" --gtest_filter="$FILTER" > "$OUT/tests.log" 2>&1; el "tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$OUT/tests.log" | head -12
for tool in memcheck racecheck synccheck; do
  timeout 200 compute-sanitizer --tool "$tool" "$TB" --gtest_filter="$SAN" > "$OUT/$tool.log" 2>&1
  el "$tool rc=$?: $(grep -E 'SUMMARY' "$OUT/$tool.log" | tail -1)"
done
for r in $ROUNDS; do
  for v in base new; do
    P="$ROOT/build-ab/py"; [ "$v" = base ] && P="$BASE/build/py"
    PYTHONPATH="$P" timeout 200 python3 $BENCH --json "$OUT/bench_${v}_$r.json" > "$OUT/bench_${v}_$r.log" 2>&1
    el "bench $v round $r rc=$?"
    grep -E "$SHOW" "$OUT/bench_${v}_$r.log" | sed -E 's/ lists equal.*//' | head -12
  done
done
if [ "${NCU:-1}" = 1 ]; then
  for v in base new; do
    P="$ROOT/build-ab/py"; [ "$v" = base ] && P="$BASE/build/py"
    timeout 100 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
      python3 "$ROOT/dev/gpu/token_max_call.py" "$P" fp8_e4m3 > "$OUT/ncu_$v.csv" 2> "$OUT/ncu_$v.err"
    el "ncu $v rc=$?"
    python3 - "$OUT/ncu_$v.csv" <<'PY'
import csv, re, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if rows:
    k, m = rows[0].index("Kernel Name"), rows[0].index("Metric Value")
    print("  " + "  ".join(f"{g.group(1)}={r[m]}" for r in rows[1:] if (g := re.search(r"(\w+)_kernel", r[k]))))
PY
  done
fi
