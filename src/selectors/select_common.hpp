// Shared pieces of the CPU selectors: ranking with the library's tie rule, writing lists, and
// loading index tensors through a quantisation precision.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/check.hpp"
#include "core/cpu.hpp"
#include "sparse_attn/selectors.hpp"

namespace sparse_attn::detail {

/// A candidate of a top-k: its score and its id. Forced candidates carry +inf.
struct Scored {
  double score;
  std::int32_t id;
};

/// Strict "ranks before": higher score first, ties to the lower id. NaN scores are mapped to -inf
/// before ranking (see `sanitize`) so this stays a strict weak order.
inline bool ranks_before(const Scored& a, const Scored& b) {
  return a.score > b.score || (a.score == b.score && a.id < b.id);
}

inline double sanitize(double s) { return std::isnan(s) ? -std::numeric_limits<double>::infinity() : s; }

/// Keeps the best min(k, n) candidates and leaves their ids ascending in ids[0, returned count).
inline std::int64_t top_k_ascending(std::vector<Scored>& cand, std::int64_t k, std::vector<std::int32_t>& ids) {
  const std::int64_t n = static_cast<std::int64_t>(cand.size());
  const std::int64_t m = std::min(n, k);
  if (m < n) std::nth_element(cand.begin(), cand.begin() + m, cand.end(), ranks_before);
  ids.resize(static_cast<std::size_t>(m));
  for (std::int64_t i = 0; i < m; ++i) ids[static_cast<std::size_t>(i)] = cand[static_cast<std::size_t>(i)].id;
  std::sort(ids.begin(), ids.end());
  return m;
}

/// Writes ids into the int32 row starting at `p` with element stride `stride`, padding the
/// remaining of `width` slots with -1.
inline void write_padded(std::int32_t* p, std::int64_t stride, std::int64_t width,
                         const std::vector<std::int32_t>& ids) {
  const std::int64_t n = static_cast<std::int64_t>(ids.size());
  for (std::int64_t s = 0; s < width; ++s) p[s * stride] = s < n ? ids[static_cast<std::size_t>(s)] : -1;
}

inline std::int32_t* idx_ptr4(const TensorView& t, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return reinterpret_cast<std::int32_t*>(addr4(t, a, b, c, d));
}

/// A [B, L, H, D] floating tensor converted to float32 and rounded through `precision`
/// (per-tensor scale over the whole tensor), stored densely as [B, L, H, D].
struct QuantizedTensor {
  std::int64_t B = 0, L = 0, H = 0, D = 0;
  std::vector<float> data;
  float tensor_scale = 1.0f;
  const float* row(std::int64_t b, std::int64_t l, std::int64_t h) const {
    return data.data() + ((b * L + l) * H + h) * D;
  }
};

/// Per-tensor scale of a precision for a tensor whose largest magnitude is `amax`: amax / 448 for
/// fp8, the scale-of-scales amax / (448 * 6) for fp4, 1 for bf16 (unused).
float precision_tensor_scale(IndexPrecision p, float amax);

/// Loads a 4-d [B, L, H, D] view (3-d views are read as H = 1) and rounds it through `p`. Throws
/// Error(op, name) at the first non-finite element.
QuantizedTensor load_quantized(const std::string& op, const std::string& name, const TensorView& t,
                               IndexPrecision p);

/// Float64 dot product of two float rows. Products of floats are exact in float64, so the result
/// is independent of FMA contraction and matches any float64 re-computation in the same order.
inline double dot_f64(const float* a, const float* b, std::int64_t n) {
  double s = 0.0;
  for (std::int64_t d = 0; d < n; ++d) s += static_cast<double>(a[d]) * static_cast<double>(b[d]);
  return s;
}

/// out[r] = dot_f64(a, rows[r], n) for r < m, bit-identical to it: each sum still runs over d in
/// order, but four independent sums are interleaved so their additions overlap in the pipeline.
inline void dots_f64(const float* a, const float* const* rows, std::int64_t m, std::int64_t n, double* out) {
  std::int64_t r = 0;
  for (; r + 4 <= m; r += 4) {
    const float *b0 = rows[r], *b1 = rows[r + 1], *b2 = rows[r + 2], *b3 = rows[r + 3];
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    for (std::int64_t d = 0; d < n; ++d) {
      const double x = a[d];
      s0 += x * static_cast<double>(b0[d]);
      s1 += x * static_cast<double>(b1[d]);
      s2 += x * static_cast<double>(b2[d]);
      s3 += x * static_cast<double>(b3[d]);
    }
    out[r] = s0, out[r + 1] = s1, out[r + 2] = s2, out[r + 3] = s3;
  }
  for (; r < m; ++r) out[r] = dot_f64(a, rows[r], n);
}

void check_precision(const std::string& op, IndexPrecision p);

}  // namespace sparse_attn::detail
