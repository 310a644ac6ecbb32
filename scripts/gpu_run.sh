#!/usr/bin/env bash
# On the GPU machine (H200): build the library with CUDA, run the GPU tests, run compute-sanitizer
# (memcheck, racecheck, synccheck) on a small GPU test, then the benchmark against peers. Logs and
# JSON go to $OUT; a short table is printed last.
#
# Usage: scripts/gpu_run.sh [--no-peers] [--quick] [--no-tests] [--no-sanitizer] [--no-bench]
# Each stage runs under a timeout (TEST_TIMEOUT, SANITIZER_TIMEOUT, BENCH_TIMEOUT seconds) so a hung
# kernel costs one stage, not the whole session.
# Build dependencies that the machine lacks (GoogleTest, nlohmann_json) are taken from .gpu/usr, a
# git-ignored copy of the Debian packages' headers, libraries and CMake configs.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
BUILD="${BUILD:-$ROOT/build-gpu}"
JOBS="${JOBS:-$(nproc)}"
PEERS=1 QUICK=0 TESTS=1 SANITIZER=1 BENCH=1
for arg in "$@"; do
  case "$arg" in
    --no-peers) PEERS=0 ;;
    --quick) QUICK=1 ;;
    --no-tests) TESTS=0 ;;
    --no-sanitizer) SANITIZER=0 ;;
    --no-bench) BENCH=0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
stamp() { date -u +%H:%M:%S; }

CUDA_HOME="${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
note "$(stamp) device: $(tail -n 1 "$OUT/nvidia-smi.csv")"

# ---- build ---------------------------------------------------------------------------------------
cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSE_ATTN_CUDA=ON \
  -DSPARSE_ATTN_BUILD_TOOLS=OFF -DCMAKE_PREFIX_PATH="$ROOT/.gpu/usr" \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed > "$OUT/configure.log" 2>&1 || { note "configure FAILED"; tail -30 "$OUT/configure.log"; exit 1; }
if ! cmake --build "$BUILD" -j "$JOBS" --target sparse_attn sparse_attn_gpu_tests > "$OUT/build.log" 2>&1; then
  note "build FAILED"; grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1
fi
g++ -O2 -std=c++20 -shared -fPIC -I"$ROOT/include" -I"$ROOT/src" "$ROOT/bench/gpu/capi.cpp" "$BUILD/libsparse_attn.a" \
  -L"$CUDA_HOME/lib64" -lcudart_static -ldl -lrt -lpthread -fopenmp -o "$BUILD/libsa_bench.so" \
  > "$OUT/build_capi.log" 2>&1 || { note "bench library build FAILED"; cat "$OUT/build_capi.log"; exit 1; }
note "$(stamp) build ok"
cuobjdump --dump-sass "$BUILD/libsparse_attn.a" 2> /dev/null | grep -oE 'HGMMA\.[0-9x]+\.[A-Z0-9.]+|UTMALDG\.[0-9A-Z]+|USETMAXREG[.A-Z]*' \
  | sort | uniq -c > "$OUT/sass_summary.txt" || true

# ---- tests ---------------------------------------------------------------------------------------
STATUS=0
TEST_BIN="$BUILD/tests/sparse_attn_gpu_tests"
if [ "$TESTS" = 1 ]; then
  if timeout "${TEST_TIMEOUT:-180}" "$TEST_BIN" > "$OUT/gpu_tests.log" 2>&1; then note "$(stamp) gpu tests: PASS"; else note "$(stamp) gpu tests: FAIL"; STATUS=1; fi
  grep -E "^\[ +(OK|FAILED|SKIPPED) +\]|relerr|Failure|Expected|Which is|error" "$OUT/gpu_tests.log" | head -60
fi

# ---- compute-sanitizer ---------------------------------------------------------------------------
if [ "$SANITIZER" = 1 ]; then
  for tool in memcheck racecheck synccheck; do
    if timeout "${SANITIZER_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 3 "$TEST_BIN" --gtest_filter='*SanitizerSmall*' \
        > "$OUT/sanitizer_$tool.log" 2>&1; then
      note "$(stamp) sanitizer $tool: clean ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer_$tool.log" | tail -1))"
    else
      note "$(stamp) sanitizer $tool: FAILED"; tail -25 "$OUT/sanitizer_$tool.log"; STATUS=1
    fi
  done
fi

# ---- benchmark -----------------------------------------------------------------------------------
if [ "$BENCH" = 1 ]; then
  BENCH_ARGS=(--lib "$BUILD/libsa_bench.so" --out "$OUT/bench_results.json")
  [ "$PEERS" = 0 ] && BENCH_ARGS+=(--no-peers)
  [ "$QUICK" = 1 ] && BENCH_ARGS+=(--quick)
  if ! timeout "${BENCH_TIMEOUT:-400}" python3 "$ROOT/bench/gpu/bench_attention.py" "${BENCH_ARGS[@]}" > "$OUT/bench.log" 2>&1; then
    note "benchmark FAILED"; tail -30 "$OUT/bench.log"; STATUS=1
  fi
fi

echo
cat "$SUMMARY"
[ -f "$OUT/sass_summary.txt" ] && cat "$OUT/sass_summary.txt"
[ "$BENCH" = 1 ] && sed -n '/^work /,$p' "$OUT/bench.log"
exit $STATUS
