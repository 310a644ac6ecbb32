#!/usr/bin/env bash
# On the GPU machine (H200): build the library with CUDA, run the GPU tests, run compute-sanitizer
# (memcheck, racecheck, synccheck) on a small GPU test, then the benchmark against peers. Logs and
# JSON go to $OUT; a short table is printed last.
#
# Usage: scripts/gpu_run.sh [--no-peers] [--quick] [--no-tests] [--no-sanitizer] [--no-bench] [--no-selector-bench]
#                           [--no-pipeline-bench] [--no-query-bench]
# Each stage runs under a timeout (TEST_TIMEOUT, SANITIZER_TIMEOUT, BENCH_TIMEOUT, SELECTOR_TIMEOUT, PIPELINE_TIMEOUT,
# QUERY_TIMEOUT, QSCHED_TIMEOUT seconds) so a hung kernel costs one stage, not the whole session.
# The benchmark stage also plots its JSON (bench/plot_attention.py) where matplotlib is installed. The
# pipeline stage runs bench/gpu/bench_pipeline.py (each selector in front of tile_sparse, FlexAttention on
# the same lists unless --no-peers) into $OUT/pipeline.json.
# The query stage also runs bench/gpu/bench_query.py (every query_sparse schedule and the Q-centric one on
# the same lists, FlexAttention unless --no-peers, dense SDPA, the overlap sweep and the planner check)
# into $OUT/query_schedules.json; --quick gives it fewer repetitions and sweep points.
# Build dependencies that the machine lacks (GoogleTest, nlohmann_json) are taken from .gpu/usr, a
# git-ignored copy of the Debian packages' headers, libraries and CMake configs.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$ROOT/gpu-out}"
BUILD="${BUILD:-$ROOT/build-gpu}"
JOBS="${JOBS:-$(nproc)}"
PEERS=1 QUICK=0 TESTS=1 SANITIZER=1 BENCH=1 SELBENCH=1 PIPEBENCH=1 QBENCH=1
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
g++ -O2 -std=c++20 -shared -fPIC -I"$ROOT/include" -I"$ROOT/src" -I"$CUDA_HOME/include" "$ROOT/bench/gpu/capi.cpp" "$BUILD/libsparse_attn.a" \
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
  elif python3 -c "import matplotlib" 2> /dev/null; then
    python3 "$ROOT/bench/plot_attention.py" "$OUT/bench_results.json" -o "$OUT/bench_tflops.png" > /dev/null \
      && note "$(stamp) plot: $OUT/bench_tflops.png" || note "plot FAILED"
  else
    note "plot skipped: matplotlib is not installed (run bench/plot_attention.py on $OUT/bench_results.json elsewhere)"
  fi
fi

# ---- selector timings (optional): the tile16 shape at Lk = 16K, top-16, one line per selector ----------
if [ "$SELBENCH" = 1 ]; then
  if ! timeout "${SELECTOR_TIMEOUT:-300}" python3 - "$BUILD/libsa_bench.so" > "$OUT/selector_bench.log" 2>&1 <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
i64 = ctypes.c_int64
lib.sa_bench_selectors.argtypes = [i64, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int,
                                   ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_int]
times = (ctypes.c_double * 5)()
err = ctypes.create_string_buffer(512)
if lib.sa_bench_selectors(2, 4096, 16384, 16, 1, 128, 16, 20, times, err, 512) != 0:
    sys.exit("selector benchmark failed: " + err.value.decode())
names = ["pooled R1", "pooled R4", "token_max bf16", "token_max fp8", "token_max fp4"]
targets = [10.0, 20.0, None, 40.0, None]
for n, t, goal in zip(names, times, targets):
    print(f"selector {n:15s} tile16 Lk=16384 top-16: {t:9.1f} us" + (f" (target <= {goal:.0f} us)" if goal else ""))
PY
  then note "selector benchmark FAILED"; tail -5 "$OUT/selector_bench.log"; STATUS=1
  else grep '^selector ' "$OUT/selector_bench.log" | while read -r line; do note "$line"; done
  fi
fi

# ---- selector -> tile_sparse pipeline against FlexAttention on the same lists (optional) -------------
if [ "$PIPEBENCH" = 1 ]; then
  PIPE_ARGS=(--lib "$BUILD/libsa_bench.so" --json "$OUT/pipeline.json")
  [ "$PEERS" = 0 ] && PIPE_ARGS+=(--no-flex)
  [ "$QUICK" = 1 ] && PIPE_ARGS+=(--quick)
  if ! timeout "${PIPELINE_TIMEOUT:-300}" python3 "$ROOT/bench/gpu/bench_pipeline.py" "${PIPE_ARGS[@]}" > "$OUT/pipeline.log" 2>&1
  then note "pipeline benchmark FAILED"; tail -20 "$OUT/pipeline.log"; STATUS=1
  else note "$(stamp) pipeline benchmark: $OUT/pipeline.json"
  fi
fi

# ---- KV-centric query_sparse (optional): query16of32 with its breakdown, and dense SDPA cuDNN -------
if [ "$QBENCH" = 1 ]; then
  if ! timeout "${QUERY_TIMEOUT:-300}" python3 - "$BUILD/libsa_bench.so" > "$OUT/query_bench.log" 2>&1 <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
i64 = ctypes.c_int64
f = lib.sa_bench_query_sparse
f.argtypes = [i64, i64, i64, i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
              ctypes.POINTER(ctypes.c_double), ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_int]
B, L, Hq, Hkv, D, K = 8, 4096, 16, 1, 128, 16
for name, bf16 in (("f32", 0), ("bf16", 1)):
    times = (ctypes.c_double * 4)()
    rel = ctypes.c_double(0.0)
    err = ctypes.create_string_buffer(1024)
    if f(B, L, Hq, Hkv, D, K, 0, bf16, 20, times, ctypes.byref(rel), err, 1024) != 0:
        sys.exit("query_sparse benchmark failed: " + err.value.decode())
    print(f"query16of32 kv-centric {name:4s} partials: reverse index {times[0]:.3f} ms, attention {times[1]:.3f} ms, "
          f"combine {times[2]:.3f} ms, one call {times[3]:.3f} ms (target <= 1.2 ms); relerr vs CPU (batch 0) {rel.value:.2e}")
try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)  # K/V repeated to Hq heads
    v = torch.randn(B, Hq, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
        sdpa()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            sdpa()
        e1.record()
        torch.cuda.synchronize()
    print(f"query16of32 dense SDPA cuDNN (same shape, all keys): {e0.elapsed_time(e1) / 20:.3f} ms")
except Exception as exc:  # the KV-centric lines above stand on their own
    print(f"query16of32 dense SDPA cuDNN: unavailable ({exc})")
PY
  then note "query_sparse benchmark FAILED"; tail -5 "$OUT/query_bench.log"; STATUS=1
  else grep '^query16of32 ' "$OUT/query_bench.log" | while read -r line; do note "$line"; done
  fi
  QS_ARGS=(--lib "$BUILD/libsa_bench.so" --json "$OUT/query_schedules.json")
  [ "$PEERS" = 0 ] && QS_ARGS+=(--no-flex)
  [ "$QUICK" = 1 ] && QS_ARGS+=(--quick)
  if ! timeout "${QSCHED_TIMEOUT:-900}" python3 "$ROOT/bench/gpu/bench_query.py" "${QS_ARGS[@]}" > "$OUT/query_schedules.log" 2>&1
  then note "query schedules benchmark FAILED"; tail -20 "$OUT/query_schedules.log"; STATUS=1
  else grep -E '^(planner right|crossover|verification)' "$OUT/query_schedules.log" | while read -r line; do note "query schedules: $line"; done
  fi
fi

echo
cat "$SUMMARY"
[ -f "$OUT/sass_summary.txt" ] && cat "$OUT/sass_summary.txt"
[ "$BENCH" = 1 ] && sed -n '/^work /,$p' "$OUT/bench.log"
[ "$PIPEBENCH" = 1 ] && [ -f "$OUT/pipeline.log" ] && sed -n '/^selector  /,$p' "$OUT/pipeline.log"
exit $STATUS
