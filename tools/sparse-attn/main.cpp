// sparse-attn: command-line front end of the library.
//   info   build configuration and CUDA devices
//   demo   selectors -> executors on a synthetic workload with planted structure
//   bench  the docs/design.md §7 workloads, verified before they are timed
//   eval   selection quality of every selector against dense attention and an oracle
//   calibrate  gated's thresholds from calibration samples
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <exception>
#include <new>

#include "bench.hpp"
#include "calibrate.hpp"
#include "common.hpp"
#include "demo.hpp"
#include "plan.hpp"
#include "eval.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace {

int run_info() {
  using sparse_attn::cli::cuda_compiled;
  const auto info = sparse_attn::build_info();
  fmt::print("sparse_attn {}\n", info.version);
  fmt::print("  compiler      {}\n", info.compiler);
  fmt::print("  cpu threads   {} (OMP_NUM_THREADS sets them)\n", info.cpu_threads);
  fmt::print("  cuda backend  {}\n",
             info.cuda ? fmt::format("yes (CUDA {}, {})", info.cuda_version, info.cuda_archs) : "no (built without nvcc)");
  const auto devices = sparse_attn::cuda_devices();
  if (devices.empty()) fmt::print("  cuda devices  none{}\n", cuda_compiled() ? "" : " (not probed: no CUDA backend)");
  for (const auto& d : devices)
    fmt::print("  cuda:{}        {} (sm_{}{}, {} SMs, {:.1f} GiB){}\n", d.index, d.name, d.major, d.minor, d.multiprocessors,
               double(d.memory_bytes) / (1024.0 * 1024.0 * 1024.0), d.supported ? "" : " - not supported (needs sm_90)");
  fmt::print("  runs on       {}\n", sparse_attn::cli::Placement::choose("auto").banner());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparse-attn: input-dependent sparse attention for long-context prefill"};
  app.require_subcommand(1);
  app.set_version_flag("--version", sparse_attn::build_info().version);

  auto* info = app.add_subcommand("info", "Build configuration and CUDA devices");

  sparse_attn::cli::DemoConfig demo_cfg;
  auto* demo = app.add_subcommand(
      "demo", "Selectors -> executors on a synthetic workload with attention sinks, local bands and planted needles");
  demo->add_option("--seed", demo_cfg.seed, "Seed of the synthetic q, k, v")
      ->capture_default_str()->check(sparse_attn::cli::unsigned_integer());
  demo->add_option("--len", demo_cfg.len, "Sequence length (queries = keys, causal)")
      ->capture_default_str()->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  demo->add_option("--batch", demo_cfg.batch, "Batch size")->capture_default_str()->check(CLI::Range(1, 64));
  demo->add_option("--heads", demo_cfg.heads, "Query heads")->capture_default_str()->check(CLI::Range(1, 256));
  demo->add_option("--kv-heads", demo_cfg.kv_heads, "KV heads (divides --heads)")
      ->capture_default_str()->check(CLI::Range(1, 256));
  demo->add_option("--budget", demo_cfg.budget, "KV blocks per Q tile (per query for QueryLists)")
      ->capture_default_str()->check(CLI::Range(1, 8192));
  demo->add_option("--needles", demo_cfg.needles, "Planted needles per (batch, KV head)")
      ->capture_default_str()->check(CLI::Range(0, 1024));
  demo->add_option("--eval-queries", demo_cfg.eval_queries,
                   "Evaluate quality in float64 on the last N queries (whole Q tiles); 0: every query")
      ->capture_default_str()->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 20));
  demo->add_option("--device", demo_cfg.device, "auto, cpu or cuda")
      ->capture_default_str()->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  demo->add_option("--json", demo_cfg.json, "Write the results as JSON to this file");

  sparse_attn::cli::BenchConfig bench_cfg;
  auto* bench = app.add_subcommand("bench", "Benchmark a docs/design.md §7 workload; every case is verified before it is timed");
  sparse_attn::cli::add_bench_options(*bench, bench_cfg);
  sparse_attn::cli::add_plan_command(app);
  sparse_attn::cli::add_calibrate_command(app);

  sparse_attn::cli::EvalConfig eval_cfg;
  auto* eval = sparse_attn::cli::add_eval_subcommand(app, eval_cfg);

  // CLI11 leaves an option given an empty value ("--dim ''" or "--dim=") at zero without running its
  // checks; no option of this program takes an empty value, so it is refused here, by name.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool empty_after = a.rfind("--", 0) == 0 && a.find('=') == std::string::npos && i + 1 < argc && argv[i + 1][0] == '\0';
    if (empty_after || (a.rfind("--", 0) == 0 && a.back() == '=')) {
      const std::string name = a.substr(0, a.find('='));
      fmt::print(stderr, "{}: empty value\nRun with --help for more information.\n", name);
      return 2;
    }
  }
  CLI11_PARSE(app, argc, argv);
  try {
    if (info->parsed()) return run_info();
    if (demo->parsed()) return sparse_attn::cli::run_demo(demo_cfg);
    if (bench->parsed()) return sparse_attn::cli::run_bench(bench_cfg);
    if (eval->parsed()) return sparse_attn::cli::run_eval(eval_cfg);
  } catch (const sparse_attn::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    fmt::print(stderr, "error: out of memory: the sizes the options ask for do not fit in this machine (std::bad_alloc)\n");
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  }
  return 0;
}
