// Selection quality (docs/design.md §5.8): how much of dense attention a selection keeps.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "sparse_attn/formats.hpp"
#include "sparse_attn/tensor.hpp"

namespace sparse_attn {

struct QualityOptions {
  std::optional<float> softmax_scale;
  bool causal = false;
};

struct QualityReport {
  // Fraction of the dense softmax mass of each query that falls on its selected keys.
  double kept_mass_mean = 0.0;
  double kept_mass_min = 0.0;
  std::vector<double> kept_mass_mean_per_head;  // [Hq]
  std::vector<double> kept_mass_min_per_head;   // [Hq]
  // ||sparse_out - dense_out|| / ||dense_out|| over the whole output, and per head.
  double out_rel_err = 0.0;
  std::vector<double> out_rel_err_per_head;     // [Hq]
  // Fraction of visible (query, key) pairs NOT selected, and of visible (Q tile, KV block) tiles
  // holding no selected pair.
  double token_sparsity = 0.0;
  double block_sparsity = 0.0;
  std::int64_t selected_pairs = 0;   // selected and visible (query head, query, key) triples
  std::int64_t visible_pairs = 0;
};

/// Evaluates `selection` on CPU tensors q, k, v (any of f32/f16/bf16) in float64. The sparse
/// output renormalises over the selected visible keys. A query that sees no key (causal, Lq > Lk)
/// is left out of the kept-mass statistics (1 when no query remains); one whose selection holds
/// no visible key keeps mass 0 and has sparse output 0. A relative error with a zero reference is
/// 0 for a zero difference, else +inf.
QualityReport evaluate_selection(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const Selection& selection, const QualityOptions& options = {});

}  // namespace sparse_attn
