// Calibrated block-max thresholds for the gated executor (docs/design.md §3, §5.5), and their calibration.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sparse_attn/tensor.hpp"

namespace sparse_attn {

/// t float32 [n_budgets, n_layers, n_heads, n_qtiles] plus the metadata that makes it meaningful.
/// Thresholds are only valid for the tile shape and model they were calibrated on.
struct ThresholdTable {
  std::vector<std::int64_t> budgets;  // k (off-diagonal blocks kept) of each budget slice
  std::int64_t n_layers = 0;
  std::int64_t n_heads = 0;
  std::int64_t n_qtiles = 0;  // calibrated gate tile positions (kGateRows queries each); later positions reuse the last
  std::int64_t tile_q = 64;   // rows of the gate tile the block maxima were taken over (kGateRows)
  std::int64_t tile_k = 128;  // keys of a KV block (kBlockK)
  std::int64_t sink_blocks = 1;  // leading KV blocks always kept, left out of the calibration: pass to GatedOptions
  std::string model;          // model identity the thresholds belong to
  std::vector<float> values;  // row-major [budgets.size(), n_layers, n_heads, n_qtiles]

  /// n_budgets x n_layers x n_heads x n_qtiles, the size `values` must have. Throws Error naming
  /// the extent when one is < 1, or when the product (in bytes) does not fit in int64.
  static std::size_t value_count(std::size_t n_budgets, std::int64_t n_layers, std::int64_t n_heads,
                                 std::int64_t n_qtiles);
  /// Throws Error unless the table is consistent: at least one budget, every budget >= 1 and none
  /// repeated, every extent >= 1 and values.size() == value_count(...). save and load check it; at and
  /// slice check the extents against values.size().
  void validate() const;

  /// `budget` is a slice index (see budget_index); qtile past the calibrated range reads the last
  /// position. Throws Error naming the index that is out of range.
  float at(std::int64_t budget, std::int64_t layer, std::int64_t head, std::int64_t qtile) const;
  /// float32 [n_heads, n_qtiles] view of one budget and layer, as gated() takes it.
  TensorView slice(std::int64_t budget, std::int64_t layer) const;
  /// Index of the slice whose budget equals k; throws if none.
  std::int64_t budget_index(std::int64_t k) const;

  /// safetensors file: tensor "thresholds" (F32) and "budgets" (I64); metadata keys "tile_q",
  /// "tile_k", "sink_blocks", "model", "format" = "sparse_attn.thresholds.v1". load() refuses a tile
  /// shape other than kGateRows x kBlockK (tables calibrated for the 128-row gate of earlier versions
  /// must be recalibrated) and reads a file without "sink_blocks" as sink_blocks = 0: such a table was
  /// calibrated with every off-diagonal block as a candidate.
  void save(const std::string& path) const;
  static ThresholdTable load(const std::string& path);
};

/// Accumulates per-sample thresholds and averages them (docs/design.md §5.5). For each sample, layer, head
/// and gate tile: sort the block maxima of the gate's candidates (visible blocks off the gate tile's
/// diagonal and past the first `sink_blocks`) and take the k-th largest; fewer than k candidates
/// gives -inf (and then the average is -inf).
class Calibrator {
 public:
  Calibrator(std::vector<std::int64_t> budgets, std::int64_t n_layers, std::string model = "",
             std::int64_t sink_blocks = 1);

  /// Adds one sample's layer: q [1, L, Hq, D], k [1, L, Hkv, D] (causal, Lq = Lk). On a CUDA device
  /// the block maxima are computed there (QK only) and the sample's thresholds come back to the host.
  void add(std::int64_t layer, const TensorView& q, const TensorView& k,
           std::optional<float> softmax_scale = std::nullopt);
  /// Averages over samples. Gate tiles past a sample's length are averaged over the samples that
  /// reach them; n_qtiles is the longest sample's.
  ThresholdTable finish() const;

 private:
  /// Adds one sample's thresholds [Hq, T, n_budgets] of `layer`.
  void accumulate(std::int64_t layer, std::int64_t Hq, std::int64_t T, const std::vector<float>& sample);

  std::vector<std::int64_t> budgets_;
  std::int64_t n_layers_;
  std::string model_;
  std::int64_t sink_blocks_;
  std::int64_t n_heads_ = -1;
  // sums and counts per [budget][layer][head][qtile]; -inf is sticky
  std::vector<std::vector<double>> sum_;       // [budget * n_layers + layer] -> [head * T + qtile]
  std::vector<std::vector<std::int64_t>> n_;   // same layout
  std::vector<std::vector<std::uint8_t>> neg_inf_;
  std::vector<std::int64_t> qtiles_;           // per layer: longest T seen
};

}  // namespace sparse_attn
