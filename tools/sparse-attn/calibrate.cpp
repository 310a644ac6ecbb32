// sparse-attn calibrate: each --input file is one sample, holding per layer l the tensors "q.<l>"
// [1, L, Hq, D] and "k.<l>" [1, L, Hkv, D] (F32, F16 or BF16; layers 0, 1, ... without a gap), or
// "q" and "k" for a single layer. The Calibrator takes them on the CPU or, with a GPU, on the device
// (16-bit inputs), and the table goes to --out.
#include "calibrate.hpp"

#include <fmt/core.h>

#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "core/safetensors.hpp"
#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::cli {
namespace {

constexpr const char* kOp = "sparse-attn calibrate";

struct CalibrateConfig {
  std::vector<std::string> inputs;
  std::vector<std::int64_t> budgets{1, 3, 7, 15};
  std::int64_t sink_blocks = 1;
  std::string model;
  std::string out;
  std::string device = "auto";
};

HostTensor entry_tensor(const detail::SafetensorsEntry& e, const std::string& path) {
  DType dtype = DType::f32;
  if (e.dtype == "F16") dtype = DType::f16;
  else if (e.dtype == "BF16") dtype = DType::bf16;
  else if (e.dtype != "F32")
    throw Error(kOp, "--input", fmt::format("{}: tensor '{}' has dtype {}, expected F32, F16 or BF16", path, e.name, e.dtype));
  if (e.shape.size() != 4 || e.shape[0] != 1)
    throw Error(kOp, "--input", fmt::format("{}: tensor '{}' must be [1, L, H, D], got {} dimensions", path, e.name, e.shape.size()));
  HostTensor t(dtype, e.shape);
  std::copy(e.data.begin(), e.data.end(), static_cast<std::byte*>(t.view().data));
  return t;
}

/// The (q, k) names of each layer of a sample file.
std::vector<std::pair<std::string, std::string>> layer_names(const detail::SafetensorsFile& f, const std::string& path) {
  if (f.contains("q") && f.contains("k")) return {{"q", "k"}};
  std::vector<std::pair<std::string, std::string>> out;
  for (int l = 0; f.contains(fmt::format("q.{}", l)) && f.contains(fmt::format("k.{}", l)); ++l)
    out.emplace_back(fmt::format("q.{}", l), fmt::format("k.{}", l));
  if (out.empty())
    throw Error(kOp, "--input", fmt::format("{}: holds neither 'q' and 'k' nor 'q.0' and 'k.0'", path));
  return out;
}

int run_calibrate(const CalibrateConfig& c) {
  const Placement where = Placement::choose(c.device);
  fmt::print("{}\n", where.banner());
  std::unique_ptr<Calibrator> cal;
  std::size_t n_layers = 0;
  for (const std::string& path : c.inputs) {
    const detail::SafetensorsFile file = detail::read_safetensors(path, std::string(kOp) + " --input");
    const auto names = layer_names(file, path);
    if (!cal) {
      n_layers = names.size();
      cal = std::make_unique<Calibrator>(c.budgets, static_cast<std::int64_t>(n_layers), c.model, c.sink_blocks);
    } else if (names.size() != n_layers) {
      throw Error(kOp, "--input", fmt::format("{}: holds {} layers, the first sample {}", path, names.size(), n_layers));
    }
    for (std::size_t l = 0; l < names.size(); ++l) {
      // 16-bit samples go to the GPU when there is one; float32 ones stay on the CPU.
      Mirrored q(entry_tensor(file.get(names[l].first), path), where), k(entry_tensor(file.get(names[l].second), path), where);
      const bool dev = where.cuda && q.host().dtype() != DType::f32;
      cal->add(static_cast<std::int64_t>(l), q.view(dev), k.view(dev));
    }
    fmt::print("[{:7.1f} s] {}: {} layer(s)\n", elapsed_s(), path, names.size());
  }
  const ThresholdTable table = cal->finish();
  table.save(c.out);
  fmt::print("wrote {}: {} budget(s) x {} layer(s) x {} heads x {} gate tiles of {} queries, sink_blocks {}\n", c.out,
             table.budgets.size(), table.n_layers, table.n_heads, table.n_qtiles, table.tile_q, table.sink_blocks);
  return 0;
}

}  // namespace

void add_calibrate_command(CLI::App& app) {
  auto cfg = std::make_shared<CalibrateConfig>();
  auto* cmd = app.add_subcommand("calibrate", "gated's thresholds from calibration samples (safetensors) -> a threshold table");
  cmd->add_option("--input", cfg->inputs, "Sample files: 'q.<layer>' [1, L, Hq, D] and 'k.<layer>' [1, L, Hkv, D] (or 'q', 'k')")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--budgets", cfg->budgets, "Blocks kept per gate tile off the diagonal and the sinks, one slice each")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  cmd->add_option("--sink-blocks", cfg->sink_blocks, "Leading KV blocks always kept (and left out of the calibration)")
      ->capture_default_str()
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd->add_option("--model", cfg->model, "Model identity recorded in the table");
  cmd->add_option("--out", cfg->out, "Threshold table to write (safetensors)")->required();
  cmd->add_option("--device", cfg->device, "auto, cpu or cuda")->capture_default_str()->check(CLI::IsMember({"auto", "cpu", "cuda"}));
  cmd->callback([cfg]() {
    try {
      check_writable(cfg->out);
      run_calibrate(*cfg);
    } catch (const CLI::Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      fmt::print(stderr, "error: out of memory: the samples do not fit in this machine (std::bad_alloc)\n");
      throw CLI::RuntimeError(2);
    } catch (const std::exception& e) {
      fmt::print(stderr, "error: {}\n", e.what());
      throw CLI::RuntimeError(2);
    }
  });
}

}  // namespace sparse_attn::cli
