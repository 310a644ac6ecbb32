// ThresholdTable (lookup, safetensors file) and Calibrator (docs/design.md §5.5).
#include "sparse_attn/thresholds.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>

#include "core/check.hpp"
#include "core/cpu.hpp"
#include "core/safetensors.hpp"
#include "gated/tile_kernels.hpp"
#include "sparse_attn/formats.hpp"
#include "sparse_attn/ops.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/backend.hpp"
#endif

namespace sparse_attn {
namespace {

constexpr const char* kFormat = "sparse_attn.thresholds.v1";
constexpr const char* kTableOp = "ThresholdTable";
constexpr const char* kCalibOp = "Calibrator";

// safetensors stores little-endian bytes; the raw copies below rely on a matching host.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

/// The checked product a * b of non-negative values, or nullopt when it exceeds `limit`.
std::optional<std::uint64_t> times(std::uint64_t a, std::uint64_t b, std::uint64_t limit) {
  if (b != 0 && a > limit / b) return std::nullopt;
  return a * b;
}

/// The extents and the size of `values` agree (what indexing needs; validate() checks the budgets too).
void check_values(const ThresholdTable& t) {
  const std::size_t expected = ThresholdTable::value_count(t.budgets.size(), t.n_layers, t.n_heads, t.n_qtiles);
  detail::require(t.values.size() == expected, kTableOp, "values", [&] {
    return "holds " + std::to_string(t.values.size()) + " values, expected " + std::to_string(expected) +
           " = budgets (" + std::to_string(t.budgets.size()) + ") x layers x heads x q tiles";
  });
}

/// Every budget >= 1 and none repeated (sorted, so a file's thousands of budgets check in n log n).
void check_budgets(const std::string& op, const std::vector<std::int64_t>& budgets) {
  for (std::size_t i = 0; i < budgets.size(); ++i)
    detail::require(budgets[i] >= 1, op, "budgets", [&] {
      return "budget " + std::to_string(budgets[i]) + " at [" + std::to_string(i) + "] must be >= 1";
    });
  std::vector<std::int64_t> sorted = budgets;
  std::sort(sorted.begin(), sorted.end());
  const auto repeat = std::adjacent_find(sorted.begin(), sorted.end());
  detail::require(repeat == sorted.end(), op, "budgets", [&] { return "budget " + std::to_string(*repeat) + " is repeated"; });
}

void check_index(const std::string& op, const std::string& name, std::int64_t i, std::int64_t n) {
  detail::require(i >= 0 && i < n, op, name,
                  [&] { return std::to_string(i) + " is out of range [0, " + std::to_string(n) + ")"; });
}

std::int64_t parse_int(const std::string& path, const std::string& key, const std::string& text) {
  std::size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  detail::require(used == text.size() && !text.empty(), kTableOp, path,
                  [&] { return "metadata '" + key + "' is not an integer: '" + detail::printable(text) + "'"; });
  return value;
}

}  // namespace

// ---- ThresholdTable ------------------------------------------------------------------------------

std::size_t ThresholdTable::value_count(std::size_t n_budgets, std::int64_t n_layers, std::int64_t n_heads,
                                        std::int64_t n_qtiles) {
  detail::require(n_budgets > 0, kTableOp, "budgets", "the table holds no budget slice");
  const std::pair<const char*, std::int64_t> extents[] = {{"n_layers", n_layers}, {"n_heads", n_heads}, {"n_qtiles", n_qtiles}};
  // Indices are computed in int64 and byte sizes from the count, so both must fit.
  constexpr std::uint64_t kLimit = std::numeric_limits<std::int64_t>::max() / sizeof(float);
  std::optional<std::uint64_t> n = n_budgets;
  for (const auto& [name, extent] : extents) {
    detail::require(extent >= 1, kTableOp, name, [&] { return "must be >= 1, got " + std::to_string(extent); });
    if (n) n = times(*n, static_cast<std::uint64_t>(extent), kLimit);
  }
  detail::require(n.has_value(), kTableOp, "values", [&] {
    return "budgets (" + std::to_string(n_budgets) + ") x n_layers (" + std::to_string(n_layers) + ") x n_heads (" +
           std::to_string(n_heads) + ") x n_qtiles (" + std::to_string(n_qtiles) + ") floats overflow int64 bytes";
  });
  return static_cast<std::size_t>(*n);
}

void ThresholdTable::validate() const {
  check_values(*this);
  check_budgets(kTableOp, budgets);
  detail::require(sink_blocks >= 0, kTableOp, "sink_blocks",
                  [&] { return "must be >= 0, got " + std::to_string(sink_blocks); });
}

float ThresholdTable::at(std::int64_t budget, std::int64_t layer, std::int64_t head, std::int64_t qtile) const {
  check_values(*this);
  check_index(kTableOp, "budget", budget, static_cast<std::int64_t>(budgets.size()));
  check_index(kTableOp, "layer", layer, n_layers);
  check_index(kTableOp, "head", head, n_heads);
  detail::require(qtile >= 0, kTableOp, "qtile", [&] { return "must be >= 0, got " + std::to_string(qtile); });
  // Positions past the calibrated length reuse the last calibrated position (docs/design.md §5.5).
  const std::int64_t t = std::min(qtile, n_qtiles - 1);
  return values[static_cast<std::size_t>(((budget * n_layers + layer) * n_heads + head) * n_qtiles + t)];
}

TensorView ThresholdTable::slice(std::int64_t budget, std::int64_t layer) const {
  check_values(*this);
  check_index(kTableOp, "budget", budget, static_cast<std::int64_t>(budgets.size()));
  check_index(kTableOp, "layer", layer, n_layers);
  // gated() only reads its thresholds, so a view of const storage is safe to hand out.
  float* base = const_cast<float*>(values.data()) + (budget * n_layers + layer) * n_heads * n_qtiles;
  return TensorView::contiguous(base, DType::f32, {n_heads, n_qtiles});
}

std::int64_t ThresholdTable::budget_index(std::int64_t k) const {
  const auto it = std::find(budgets.begin(), budgets.end(), k);
  if (it == budgets.end()) {
    std::string have;
    for (std::int64_t b : budgets) have += (have.empty() ? "" : ", ") + std::to_string(b);
    throw Error(kTableOp, "k", "no slice for budget " + std::to_string(k) + " (budgets: [" + have + "])");
  }
  return static_cast<std::int64_t>(it - budgets.begin());
}

void ThresholdTable::save(const std::string& path) const {
  validate();
  detail::SafetensorsFile file;
  file.metadata["format"] = kFormat;
  file.metadata["tile_q"] = std::to_string(tile_q);
  file.metadata["tile_k"] = std::to_string(tile_k);
  file.metadata["sink_blocks"] = std::to_string(sink_blocks);
  file.metadata["model"] = model;

  detail::SafetensorsEntry t;
  t.name = "thresholds";
  t.dtype = "F32";
  t.shape = {static_cast<std::int64_t>(budgets.size()), n_layers, n_heads, n_qtiles};
  t.data.resize(values.size() * sizeof(float));
  std::memcpy(t.data.data(), values.data(), t.data.size());

  detail::SafetensorsEntry b;
  b.name = "budgets";
  b.dtype = "I64";
  b.shape = {static_cast<std::int64_t>(budgets.size())};
  b.data.resize(budgets.size() * sizeof(std::int64_t));
  std::memcpy(b.data.data(), budgets.data(), b.data.size());

  file.tensors.push_back(std::move(t));
  file.tensors.push_back(std::move(b));
  detail::write_safetensors(path, file);
}

ThresholdTable ThresholdTable::load(const std::string& path) {
  const detail::SafetensorsFile file = detail::read_safetensors(path, kTableOp);
  const auto meta = [&](const std::string& key) -> const std::string& {
    const auto it = file.metadata.find(key);
    detail::require(it != file.metadata.end(), kTableOp, path, [&] { return "metadata key '" + key + "' is missing"; });
    return it->second;
  };
  const std::string& format = meta("format");
  detail::require(format == kFormat, kTableOp, path,
                  [&] { return
                      "format '" + detail::printable(format) + "' is not a threshold table (expected '" + std::string(kFormat) + "')"; });

  ThresholdTable table;
  table.tile_q = parse_int(path, "tile_q", meta("tile_q"));
  table.tile_k = parse_int(path, "tile_k", meta("tile_k"));
  // Block maxima depend on the gate tile's shape; thresholds calibrated for another one are
  // meaningless here (the 128-row gate of earlier versions included).
  detail::require(table.tile_q == kGateRows && table.tile_k == kBlockK, kTableOp, path,
                  [&] { return "thresholds were calibrated for gate tiles of " + std::to_string(table.tile_q) + " x " +
                      std::to_string(table.tile_k) + ", this library gates " + std::to_string(kGateRows) + " x " +
                      std::to_string(kBlockK) + " (docs/design.md §5.5): recalibrate"; });
  // Tables written before sink blocks existed treated every off-diagonal block as a candidate.
  const auto sinks = file.metadata.find("sink_blocks");
  table.sink_blocks = sinks == file.metadata.end() ? 0 : parse_int(path, "sink_blocks", sinks->second);
  detail::require(table.sink_blocks >= 0, kTableOp, path,
                  [&] { return "metadata 'sink_blocks' must be >= 0, got " + std::to_string(table.sink_blocks); });
  table.model = meta("model");

  const detail::SafetensorsEntry& t = file.get("thresholds");
  const detail::SafetensorsEntry& b = file.get("budgets");
  detail::require(t.dtype == "F32" && t.shape.size() == 4, kTableOp, path,
                  [&] { return "tensor 'thresholds' must be F32 with 4 dimensions, got " + t.dtype + " with " +
                      std::to_string(t.shape.size()); });
  detail::require(b.dtype == "I64" && b.shape.size() == 1 && b.shape[0] == t.shape[0], kTableOp, path,
                  [&] { return
                      "tensor 'budgets' must be I64 [" + std::to_string(t.shape[0]) + "], got " + b.dtype + " with " +
                      std::to_string(b.shape.size()) + " dimensions"; });
  // The reader checked each byte size against its shape and dtype.
  table.budgets.resize(b.data.size() / sizeof(std::int64_t));
  std::memcpy(table.budgets.data(), b.data.data(), b.data.size());
  table.n_layers = t.shape[1];
  table.n_heads = t.shape[2];
  table.n_qtiles = t.shape[3];
  table.values.resize(t.data.size() / sizeof(float));
  std::memcpy(table.values.data(), t.data.data(), t.data.size());
  try {
    table.validate();
  } catch (const Error& e) {
    throw Error(kTableOp, path, "the file holds an invalid table: " + std::string(e.what()));
  }
  const std::size_t n = table.values.size();
  for (std::size_t i = 0; i < n; ++i)
    detail::require(!std::isnan(table.values[i]), kTableOp, path,
                    [&] { return "threshold " + std::to_string(i) + " is NaN"; });
  return table;
}

// ---- Calibrator ----------------------------------------------------------------------------------

Calibrator::Calibrator(std::vector<std::int64_t> budgets, std::int64_t n_layers, std::string model,
                       std::int64_t sink_blocks)
    : budgets_(std::move(budgets)), n_layers_(n_layers), model_(std::move(model)), sink_blocks_(sink_blocks) {
  detail::require(!budgets_.empty(), kCalibOp, "budgets", "needs at least one budget");
  check_budgets(kCalibOp, budgets_);
  detail::require(n_layers_ >= 1, kCalibOp, "n_layers",
                  [&] { return "must be >= 1, got " + std::to_string(n_layers_); });
  detail::require(sink_blocks_ >= 0, kCalibOp, "sink_blocks",
                  [&] { return "must be >= 0, got " + std::to_string(sink_blocks_); });
  const std::size_t slices = budgets_.size() * static_cast<std::size_t>(n_layers_);
  sum_.resize(slices);
  n_.resize(slices);
  neg_inf_.resize(slices);
  qtiles_.assign(static_cast<std::size_t>(n_layers_), 0);
}

void Calibrator::add(std::int64_t layer, const TensorView& q, const TensorView& k, std::optional<float> softmax_scale) {
  check_index(kCalibOp, "layer", layer, n_layers_);
  const auto floats = {DType::f32, DType::f16, DType::bf16};
  detail::check_tensor(kCalibOp, "q", q, 4, floats);
  detail::check_tensor(kCalibOp, "k", k, 4, floats);
  detail::check_same_device(kCalibOp, "k", k, "q", q);
  detail::check_last_contiguous(kCalibOp, "q", q);
  detail::check_last_contiguous(kCalibOp, "k", k);
  ProblemShape p;
  p.B = q.shape[0];
  p.Lq = q.shape[1];
  p.Hq = q.shape[2];
  p.D = q.shape[3];
  p.Lk = k.shape[1];
  p.Hkv = k.shape[2];
  p.causal = true;
  detail::require(p.B == 1, kCalibOp, "q",
                  [&] { return "expected one sample [1, L, Hq, D], got " + detail::shape_string(q); });
  detail::require(p.Lq > 0 && p.Hq > 0 && p.D > 0, kCalibOp, "q",
                  [&] { return "every extent must be > 0, got " + detail::shape_string(q); });
  detail::require(p.Hkv > 0, kCalibOp, "k", [&] { return "every extent must be > 0, got " + detail::shape_string(k); });
  detail::check_shape(kCalibOp, "k", k, {1, p.Lq, -1, p.D});
  detail::check_head_ratio(kCalibOp, "k", p.Hq, p.Hkv);
  detail::require(n_heads_ < 0 || n_heads_ == p.Hq, kCalibOp, "q",
                  [&] { return
                      "has " + std::to_string(p.Hq) + " query heads, earlier samples had " +
                      std::to_string(n_heads_); });
  const float scale = resolve_scale(kCalibOp, softmax_scale, p.D);

  const std::int64_t T = detail::gate_tiles(p), nb = static_cast<std::int64_t>(budgets_.size());
  if (q.device == Device::cuda) {
#if defined(SPARSE_ATTN_WITH_CUDA)
    accumulate(layer, p.Hq, T, cuda_backend::calibration_sample(q, k, scale, sink_blocks_, budgets_, kCalibOp));
    return;
#else
    detail::unsupported_device(kCalibOp, "q", q);
#endif
  }
  // Per (head, gate tile): the sample's threshold of every budget, computed in parallel, then
  // accumulated serially so the sums do not depend on scheduling.
  std::vector<float> sample(static_cast<std::size_t>(p.Hq * T * nb));
  detail::parallel_for(p.Hq * T, [&](std::int64_t item) {
    const std::int64_t h = item / T, t = item % T, hk = h / p.group_size();
    const detail::Span rows = detail::gate_tile_rows(p, t);
    detail::TileScratch w(p.D);
    detail::pack_rows(q, 0, h, rows, w.q.data());
    std::vector<float> maxima;
    for (std::int64_t j = 0; j < detail::visible_blocks(p, rows); ++j) {
      const detail::Span keys = detail::kv_block_keys(p, j);
      // The diagonal and the sinks are kept outside the budget.
      if (!detail::gate_candidate(p, rows, keys, j, sink_blocks_)) continue;
      detail::pack_keys_transposed(k, 0, hk, keys, w.kt.data(), w.row.data());
      detail::tile_scores(w.q.data(), rows.size(), w.kt.data(), keys.size(), p.D, scale, w.s.data());
      float m = -std::numeric_limits<float>::infinity();
      for (std::int64_t r = 0; r < rows.size(); ++r)
        for (std::int64_t c = 0; c < keys.size(); ++c) m = std::max(m, w.s[static_cast<std::size_t>(r * kBlockK + c)]);
      maxima.push_back(m);
    }
    std::sort(maxima.begin(), maxima.end(), std::greater<float>());
    for (std::int64_t bi = 0; bi < nb; ++bi) {
      const std::int64_t kk = budgets_[static_cast<std::size_t>(bi)];
      // Too short a history to prune: never gate it (docs/design.md §5.5).
      sample[static_cast<std::size_t>(item * nb + bi)] = static_cast<std::int64_t>(maxima.size()) >= kk
                                                             ? maxima[static_cast<std::size_t>(kk - 1)]
                                                             : -std::numeric_limits<float>::infinity();
    }
  });
  accumulate(layer, p.Hq, T, sample);
}

void Calibrator::accumulate(std::int64_t layer, std::int64_t Hq, std::int64_t T, const std::vector<float>& sample) {
  const std::int64_t nb = static_cast<std::int64_t>(budgets_.size());
  n_heads_ = Hq;
  std::int64_t& layer_T = qtiles_[static_cast<std::size_t>(layer)];
  const std::int64_t new_T = std::max(layer_T, T);
  for (std::int64_t bi = 0; bi < nb; ++bi) {
    const std::size_t s = static_cast<std::size_t>(bi * n_layers_ + layer);
    if (new_T != layer_T) {
      // Re-lay the [head, qtile] accumulators out for the longer tile count.
      std::vector<double> sum(static_cast<std::size_t>(Hq * new_T), 0.0);
      std::vector<std::int64_t> n(sum.size(), 0);
      std::vector<std::uint8_t> neg(sum.size(), 0);
      for (std::int64_t h = 0; h < Hq && layer_T > 0; ++h)
        for (std::int64_t t = 0; t < layer_T; ++t) {
          const std::size_t from = static_cast<std::size_t>(h * layer_T + t), to = static_cast<std::size_t>(h * new_T + t);
          sum[to] = sum_[s][from];
          n[to] = n_[s][from];
          neg[to] = neg_inf_[s][from];
        }
      sum_[s] = std::move(sum);
      n_[s] = std::move(n);
      neg_inf_[s] = std::move(neg);
    }
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const float x = sample[static_cast<std::size_t>((h * T + t) * nb + bi)];
        const std::size_t at = static_cast<std::size_t>(h * new_T + t);
        ++n_[s][at];
        if (std::isinf(x)) neg_inf_[s][at] = 1;  // one unprunable sample keeps the position unpruned
        else sum_[s][at] += x;
      }
  }
  layer_T = new_T;
}

ThresholdTable Calibrator::finish() const {
  detail::require(n_heads_ > 0, kCalibOp, "", "no calibration sample was added");
  ThresholdTable table;
  table.budgets = budgets_;
  table.n_layers = n_layers_;
  table.n_heads = n_heads_;
  table.tile_q = kGateRows;
  table.tile_k = kBlockK;
  table.sink_blocks = sink_blocks_;
  table.model = model_;
  for (std::int64_t l = 0; l < n_layers_; ++l) {
    detail::require(qtiles_[static_cast<std::size_t>(l)] > 0, kCalibOp, "layer",
                    [&] { return "layer " + std::to_string(l) + " has no calibration sample"; });
    table.n_qtiles = std::max(table.n_qtiles, qtiles_[static_cast<std::size_t>(l)]);
  }
  const std::int64_t nq = table.n_qtiles;
  table.values.resize(budgets_.size() * static_cast<std::size_t>(n_layers_ * n_heads_ * nq));
  for (std::size_t bi = 0; bi < budgets_.size(); ++bi)
    for (std::int64_t l = 0; l < n_layers_; ++l) {
      const std::size_t s = bi * static_cast<std::size_t>(n_layers_) + static_cast<std::size_t>(l);
      const std::int64_t T = qtiles_[static_cast<std::size_t>(l)];
      for (std::int64_t h = 0; h < n_heads_; ++h)
        for (std::int64_t t = 0; t < nq; ++t) {
          // A layer calibrated on shorter samples than another reuses its last calibrated position,
          // as gated() does for positions past the table.
          const std::size_t at = static_cast<std::size_t>(h * T + std::min(t, T - 1));
          const float value = neg_inf_[s][at] ? -std::numeric_limits<float>::infinity()
                                              : static_cast<float>(sum_[s][at] / static_cast<double>(n_[s][at]));
          table.values[((bi * static_cast<std::size_t>(n_layers_) + static_cast<std::size_t>(l)) * static_cast<std::size_t>(n_heads_) +
                        static_cast<std::size_t>(h)) * static_cast<std::size_t>(nq) + static_cast<std::size_t>(t)] = value;
        }
    }
  return table;
}

}  // namespace sparse_attn
