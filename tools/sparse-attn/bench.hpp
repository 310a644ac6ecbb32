// `sparse-attn bench <workload>`: the docs/design.md §7 workloads, each case verified against a float64
// reference before it is timed, with useful FLOPs counted from the pairs actually selected.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace sparse_attn::cli {

struct BenchConfig {
  std::string workload;                 // tile16, pipeline, dense, query16of32, query-long, gated, entmax
  std::string pattern = "independent";  // tile16: independent lists, or pairs of tiles sharing one
  std::vector<std::int64_t> lk;         // full-scale lengths; empty: the workload's defaults
  int repeat = 0;                       // timed runs per case; 0: 5 on the GPU, 2 on the CPU
  double sustain_ms = 0.0;  // > 0: each timed run is as many back-to-back calls as fill this many ms
  int scale = 0;  // divides B, L and block counts; 0: 1 on the GPU, 4 (gated 16, entmax 8) on the CPU
  std::vector<double> densities{1.0, 0.7, 0.5, 0.36, 0.2};  // gated: target block densities, a case each
  std::string partials = "both";        // query workloads: KV-centric partials f32, bf16 or both (a case each)
  int verify_rows = 48;                 // sampled (batch, query, head) rows checked per case
  std::uint64_t seed = 1;
  std::string device = "auto";
  std::string json;
};

void add_bench_options(CLI::App& app, BenchConfig& config);
int run_bench(const BenchConfig& config);

}  // namespace sparse_attn::cli
