// Test utilities: random inputs, poisoned outputs, and the float64 reference attention that applies a
// selection as an explicit mask (docs/design.md §6).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparse_attn/sparse_attn.hpp"

namespace sparse_attn::testing {

/// Fresh normal(0, stddev) values stored in `dtype` (never zeros).
HostTensor random_tensor(DType dtype, std::vector<std::int64_t> shape, std::uint64_t seed, float stddev = 1.0f);
/// Fills a floating tensor with NaN (integers with 0x7fffffff) so unwritten elements are detected.
void poison(HostTensor& t);
/// Element i (row-major) of a floating host tensor, as double.
double element(const HostTensor& t, std::int64_t i);
/// True when no element is NaN (infinities allowed only where `allow_inf`).
bool all_finite(const HostTensor& t, bool allow_neg_inf = false);

struct Reference {
  std::vector<double> out;  // [B, Lq, Hq, D]
  std::vector<double> lse;  // [B, Hq, Lq]; -inf for a query that sees no key
};

/// Queries that see no key (reference lse -inf): requires lse exactly -inf and out exactly 0 in the
/// result (out [B, Lq, Hq, D] and lse [B, Hq, Lq], densely packed); failures name `what` and the
/// (b, head, query). Returns the number of such rows.
std::int64_t expect_empty_rows(const HostTensor& out, const HostTensor& lse, const Reference& ref, const std::string& what);

/// Softmax attention in float64 over the explicit mask of `selection` (selection_row), with the
/// inputs read exactly as stored. A query with an empty row gets out = 0, lse = -inf.
Reference reference_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                              const Selection& selection, const ProblemShape& p, double scale);

/// ||out - ref|| / ||ref|| over all elements (NaN in out gives +inf).
double rel_err(const HostTensor& out, const std::vector<double>& ref);
/// max |out - ref| (NaN gives +inf).
double max_abs_err(const HostTensor& out, const std::vector<double>& ref);
/// max |lse - ref| over finite entries; +inf if the -inf pattern differs or lse holds NaN.
double lse_max_err(const HostTensor& lse, const std::vector<double>& ref);

/// Expects every counter of gated's statistics to be equal (gtest failures, one per counter).
void expect_gated_stats_eq(const GatedStats& got, const GatedStats& want);

}  // namespace sparse_attn::testing
