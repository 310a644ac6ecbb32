// `sparse-attn eval`: selection quality (docs/design.md §5.8) of every selector against dense attention,
// over a list of budgets, with an oracle (top blocks / keys by true attention mass) as the bound.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace sparse_attn::cli {

struct EvalConfig {
  // Exactly one source: a safetensors file, the synthetic workload, or (save mode) writing the
  // synthetic workload to a file for a later --input.
  std::string input;
  bool synthetic = false;
  std::string save_synthetic;
  std::vector<std::string> save_tensors;  // empty: all of q, k, v, qidx, kidx, qI, w, kI

  // The synthetic workload (as `demo` builds it).
  std::uint64_t seed = 1;
  std::int64_t batch = 1;
  std::int64_t len = 4096;
  std::int64_t heads = 8;
  std::int64_t kv_heads = 2;
  int needles = 4;

  std::vector<std::string> selectors{"all"};
  std::vector<int> budgets{4};  // KV blocks per Q tile / per query; token selections keep 128x as many keys
  // Quality is measured on the last eval_queries queries (whole Q tiles); 0: every query;
  // -1: 512 for the synthetic workload, every query for --input.
  std::int64_t eval_queries = -1;
  bool non_causal = false;             // --input only; the synthetic workload is causal
  std::optional<float> softmax_scale;  // default 1/sqrt(D)
  std::string json;
};

/// Adds the `eval` subcommand and its options to `app`; the options write into `config`.
CLI::App* add_eval_subcommand(CLI::App& app, EvalConfig& config);
int run_eval(const EvalConfig& config);

}  // namespace sparse_attn::cli
