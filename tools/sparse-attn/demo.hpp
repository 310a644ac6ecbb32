// `sparse-attn demo`: selectors -> executors on a synthetic workload with planted structure.
#pragma once

#include <cstdint>
#include <string>

namespace sparse_attn::cli {

struct DemoConfig {
  std::uint64_t seed = 1;
  std::int64_t batch = 1;
  std::int64_t len = 4096;
  std::int64_t heads = 8;
  std::int64_t kv_heads = 2;
  int budget = 8;       // KV blocks per Q tile (or per query); lightning keeps budget * 128 keys
  int needles = 4;      // planted needles per (batch, KV head)
  // Quality (kept mass, error, sparsity) is evaluated in float64 on the last eval_queries queries,
  // rounded up to whole Q tiles; 0 evaluates every query.
  std::int64_t eval_queries = 512;
  std::string device = "auto";
  std::string json;     // write results here when set
};

int run_demo(const DemoConfig& config);

}  // namespace sparse_attn::cli
