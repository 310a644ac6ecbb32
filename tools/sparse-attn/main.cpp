// sparse-attn: command-line front end of the library.
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "sparse_attn/sparse_attn.hpp"

namespace {

int run_info() {
  const auto info = sparse_attn::build_info();
  fmt::print("sparse_attn {}\n", info.version);
  fmt::print("  compiler     {}\n", info.compiler);
  fmt::print("  cpu threads  {}\n", info.cpu_threads);
  fmt::print("  cuda backend {}\n", info.cuda ? fmt::format("yes (CUDA {}, {})", info.cuda_version, info.cuda_archs) : "no");
  const auto devices = sparse_attn::cuda_devices();
  if (devices.empty()) fmt::print("  cuda devices none\n");
  for (const auto& d : devices)
    fmt::print("  cuda:{}       {} (sm_{}{}, {} SMs, {:.1f} GiB){}\n", d.index, d.name, d.major, d.minor, d.multiprocessors,
               double(d.memory_bytes) / (1024.0 * 1024.0 * 1024.0), d.supported ? "" : " - not supported (needs sm_90)");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"sparse-attn: input-dependent sparse attention for long-context prefill"};
  app.require_subcommand(1);
  auto* info = app.add_subcommand("info", "Build configuration and CUDA devices");
  CLI11_PARSE(app, argc, argv);
  try {
    if (info->parsed()) return run_info();
  } catch (const sparse_attn::Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 2;
  }
  return 0;
}
