#!/usr/bin/env bash
# On the GPU machine (H200): build the library with CUDA, its Python package and (where CLI11 and fmt are
# found) the sparse-attn program, run the GPU tests, run compute-sanitizer (memcheck, racecheck, synccheck)
# on a small GPU test, then the benchmarks against peers. Logs and JSON go to $OUT; a short table is
# printed last.
#
# Usage: scripts/gpu_run.sh [--no-peers] [--quick] [--no-tests] [--no-sanitizer] [--no-bench] [--no-selector-bench]
#                           [--no-pipeline-bench] [--no-query-bench] [--no-lightning-bench] [--no-entmax-bench]
# Each stage runs under a timeout (TEST_TIMEOUT, SANITIZER_TIMEOUT, BENCH_TIMEOUT, SELECTOR_TIMEOUT, PIPELINE_TIMEOUT,
# QUERY_TIMEOUT, QSCHED_TIMEOUT, LIGHTNING_TIMEOUT, ENTMAX_TIMEOUT seconds) so a hung kernel costs one stage, not the whole session.
# The benchmarks are the scripts of bench/gpu (sharing bench/harness.py), which call the library through the
# Python package built here (staged in $BUILD/py, put on PYTHONPATH):
#   bench       bench_attention.py -> $OUT/bench_results.json, plotted by bench/plot_attention.py where
#               matplotlib is installed;
#   selector    bench_selectors.py (each CUDA selector on the tile16 shape at Lk = 16K) -> $OUT/selector_bench.json;
#   pipeline    bench_pipeline.py (each selector in front of tile_sparse, FlexAttention on the same lists) ->
#               $OUT/pipeline.json;
#   query       `sparse-attn bench query16of32` (the KV-centric breakdown, verified) -> $OUT/query_bench.json where
#               the program was built, then bench_query.py (every query_sparse schedule and the Q-centric one on
#               the same lists, the peers, the overlap sweep and the planner check) -> $OUT/query_schedules.json;
#   lightning   bench_lightning.py (the lightning indexer against the fp8 matmul rate) -> $OUT/lightning.json;
#   entmax      `sparse-attn bench entmax` (whole call, output pass alone, the library's dense) -> $OUT/entmax_bench.json
#               where the program was built, then bench_entmax.py (AdaSplash where importable, cuDNN) ->
#               $OUT/entmax.json.
# --no-peers times the library alone; --quick gives every benchmark fewer cases and shorter timing. The JSON
# files record the git commit of the checkout, or $GIT_COMMIT where the tree is a copy without .git.
# Build dependencies that the machine lacks (GoogleTest, nlohmann_json, and CLI11 and fmt for the program) are
# taken from .gpu/usr, a git-ignored copy of the Debian packages' headers, libraries and CMake configs.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
BUILD="${BUILD:-$ROOT/build-gpu}"
JOBS="${JOBS:-$(nproc)}"
PEERS=1 QUICK=0 TESTS=1 SANITIZER=1 BENCH=1 SELBENCH=1 PIPEBENCH=1 QBENCH=1 LBENCH=1 EBENCH=1
for arg in "$@"; do
  case "$arg" in
    --no-peers) PEERS=0 ;;
    --quick) QUICK=1 ;;
    --no-tests) TESTS=0 ;;
    --no-sanitizer) SANITIZER=0 ;;
    --no-bench) BENCH=0 ;;
    --no-selector-bench) SELBENCH=0 ;;
    --no-pipeline-bench) PIPEBENCH=0 ;;
    --no-query-bench) QBENCH=0 ;;
    --no-lightning-bench) LBENCH=0 ;;
    --no-entmax-bench) EBENCH=0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
stamp() { date -u +%H:%M:%S; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/nvidia-smi.csv" 2>&1
note "$(stamp) device: $(tail -n 1 "$OUT/nvidia-smi.csv")"

# ---- build ---------------------------------------------------------------------------------------
configure() {
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSE_ATTN_CUDA=ON -DSPARSE_ATTN_BUILD_PYTHON=ON \
    -DSPARSE_ATTN_BUILD_TOOLS="$1" -DPython_EXECUTABLE="$(command -v python3)" -DCMAKE_PREFIX_PATH="$ROOT/.gpu/usr" \
    -DCMAKE_EXE_LINKER_FLAGS=-Wl,--as-needed
}
TARGETS=(sparse_attn sparse_attn_gpu_tests _ext)
if configure ON > "$OUT/configure.log" 2>&1; then
  TARGETS+=(sparse-attn)
elif configure OFF > "$OUT/configure.log" 2>&1; then
  note "sparse-attn program not built (CLI11 or fmt missing, see configure.log): no KV-centric breakdown"
else
  note "configure FAILED"; tail -30 "$OUT/configure.log"; exit 1
fi
if ! cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" > "$OUT/build.log" 2>&1; then
  note "build FAILED"; grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1
fi
# The Python package as pip would install it: the modules and the extension module side by side.
PKG="$BUILD/py"
rm -rf "$PKG/sparse_attn" && mkdir -p "$PKG/sparse_attn"
cp "$ROOT"/python/sparse_attn/*.py "$PKG/sparse_attn/" && cp "$BUILD"/python/_ext*.so "$PKG/sparse_attn/"
export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! python3 -c "import sparse_attn, sys; sys.exit(0 if sparse_attn.build_info()['cuda'] else 'no CUDA backend')" \
    > "$OUT/package.log" 2>&1; then
  note "python package FAILED"; cat "$OUT/package.log"; exit 1
fi
note "$(stamp) build ok (python package in $PKG${TARGETS[3]:+, sparse-attn program})"
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

# ---- benchmarks ----------------------------------------------------------------------------------
COMMON=()
[ "$QUICK" = 1 ] && COMMON+=(--quick)
PEER_ARGS=("${COMMON[@]}")
[ "$PEERS" = 0 ] && PEER_ARGS+=(--no-peers)
# stage NAME TIMEOUT LOG COMMAND...: runs one benchmark; a failure is noted with the end of its log.
stage() {
  local name="$1" limit="$2" log="$3"
  shift 3
  if timeout "$limit" "$@" > "$log" 2>&1; then return 0; fi
  note "$name FAILED"; tail -25 "$log"; STATUS=1; return 1
}

if [ "$BENCH" = 1 ] && stage benchmark "${BENCH_TIMEOUT:-600}" "$OUT/bench.log" \
    python3 "$ROOT/bench/gpu/bench_attention.py" --json "$OUT/bench_results.json" "${PEER_ARGS[@]}"; then
  if python3 -c "import matplotlib" 2> /dev/null; then
    python3 "$ROOT/bench/plot_attention.py" "$OUT/bench_results.json" -o "$OUT/bench_tflops.png" > /dev/null \
      && note "$(stamp) plot: $OUT/bench_tflops.png" || note "plot FAILED"
  else
    note "plot skipped: matplotlib is not installed (run bench/plot_attention.py on $OUT/bench_results.json elsewhere)"
  fi
fi

# ---- selector timings: the tile16 shape at Lk = 16K, top-16, one line per selector --------------------
if [ "$SELBENCH" = 1 ] && stage "selector benchmark" "${SELECTOR_TIMEOUT:-300}" "$OUT/selector_bench.log" \
    python3 "$ROOT/bench/gpu/bench_selectors.py" --json "$OUT/selector_bench.json" "${COMMON[@]}"; then
  grep '^selector ' "$OUT/selector_bench.log" | while read -r line; do note "$line"; done
fi

# ---- selector -> tile_sparse pipeline against FlexAttention on the same lists ------------------------
if [ "$PIPEBENCH" = 1 ] && stage "pipeline benchmark" "${PIPELINE_TIMEOUT:-400}" "$OUT/pipeline.log" \
    python3 "$ROOT/bench/gpu/bench_pipeline.py" --json "$OUT/pipeline.json" "${PEER_ARGS[@]}"; then
  note "$(stamp) pipeline benchmark: $OUT/pipeline.json"
fi

# ---- per-query lists: the KV-centric breakdown (sparse-attn), then every schedule and the planner ------
if [ "$QBENCH" = 1 ]; then
  CLI="$BUILD/tools/sparse-attn"
  if [ -x "$CLI" ] && stage "query_sparse breakdown" "${QUERY_TIMEOUT:-300}" "$OUT/query_bench.log" \
      "$CLI" bench query16of32 --device cuda --json "$OUT/query_bench.json"; then
    grep '^query16of32 ' "$OUT/query_bench.log" | while read -r line; do note "$line"; done
  fi
  if stage "query schedules benchmark" "${QSCHED_TIMEOUT:-900}" "$OUT/query_schedules.log" \
      python3 "$ROOT/bench/gpu/bench_query.py" --json "$OUT/query_schedules.json" "${PEER_ARGS[@]}"; then
    grep -E '^(planner right|crossover|verification)' "$OUT/query_schedules.log" | while read -r line; do note "query schedules: $line"; done
  fi
fi

# ---- lightning indexer against the fp8 matmul rate ----------------------------------------------------
if [ "$LBENCH" = 1 ] && stage "lightning benchmark" "${LIGHTNING_TIMEOUT:-300}" "$OUT/lightning.log" \
    python3 "$ROOT/bench/gpu/bench_lightning.py" --json "$OUT/lightning.json" "${COMMON[@]}"; then
  grep -E '^(fp8_e4m3|bf16): ' "$OUT/lightning.log" | while read -r line; do note "lightning $line"; done
fi

# ---- entmax: the whole call, the output pass alone and dense (sparse-attn), then AdaSplash and cuDNN -------
if [ "$EBENCH" = 1 ]; then
  CLI="$BUILD/tools/sparse-attn"
  if [ -x "$CLI" ] && stage "entmax breakdown" "${ENTMAX_TIMEOUT:-600}" "$OUT/entmax_bench.log" \
      "$CLI" bench entmax --device cuda --json "$OUT/entmax_bench.json"; then
    grep '^entmax ' "$OUT/entmax_bench.log" | while read -r line; do note "$line"; done
  fi
  if stage "entmax benchmark" "${ENTMAX_TIMEOUT:-600}" "$OUT/entmax.log" \
      python3 "$ROOT/bench/gpu/bench_entmax.py" --json "$OUT/entmax.json" "${PEER_ARGS[@]}"; then
    note "$(stamp) entmax benchmark: $OUT/entmax.json"
  fi
fi

echo
cat "$SUMMARY"
[ -f "$OUT/sass_summary.txt" ] && cat "$OUT/sass_summary.txt"
[ "$BENCH" = 1 ] && [ -f "$OUT/bench.log" ] && sed -n '/^work /,$p' "$OUT/bench.log"
[ "$PIPEBENCH" = 1 ] && [ -f "$OUT/pipeline.log" ] && sed -n '/^selector  /,$p' "$OUT/pipeline.log"
exit $STATUS
