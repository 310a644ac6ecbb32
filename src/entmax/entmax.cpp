// alpha-entmax attention with block skipping (docs/design.md §5.6, AdaSplash-style passes).
//
// Per (b, h, Q tile) work item, scores are recomputed per pass rather than stored, so scratch
// memory stays O(tile x block) whatever Lk is:
//   1. row max of z = scale * q.k over the visible keys;
//   2. a histogram of the shifted scores u = (alpha - 1)(z - max z) + 1 over [0, 1]; its root tau_h
//      satisfies tau* - h <= tau_h <= tau* (h = 1 / bins), so u > tau_h is a safe candidate set;
//   3. the candidates' real scores z, on which the exact support (the scores >= its smallest one) and
//      the threshold relative to that smallest score are solved (threshold_solver.hpp);
//   4. a BlockBits word set of the (tile, block) pairs holding any support entry;
//   5. the output pass, which visits only the set bits (popcount, n-th set bit).
#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/call.hpp"
#include "core/check.hpp"
#include "core/cpu.hpp"
#include "entmax/threshold_solver.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/backend.hpp"
#include "cuda/entmax/backend.hpp"
#endif
#include "gated/tile_kernels.hpp"
#include "sparse_attn/ops.hpp"

namespace sparse_attn {
namespace {

constexpr const char* kOp = "entmax";
// Histograms live per row of a tile for the duration of a pass; more bins than this buys no
// useful tightening of the bound and would only grow the scratch space.
constexpr int kMaxHistogramBins = 1 << 12;
// Slack (in shifted-score units, where the support lies within [0, 1]) subtracted from the
// histogram root before it rejects candidates, so rounding in the root finder can only add
// candidates, never drop a support entry.
constexpr double kCandidateSlack = 1e-7;

/// Index of the n-th (zero-based) set bit of a word holding more than n set bits.
inline int nth_set_bit(std::uint32_t word, int n) {
  for (int i = 0; i < n; ++i) word &= word - 1;  // clear the lowest set bit n times
  return std::countr_zero(word);
}

struct TileCounts {
  std::int64_t active = 0, visible = 0, support = 0;
};

class EntmaxTile {
 public:
  EntmaxTile(const TensorView& q, const TensorView& k, const TensorView& v, const ProblemShape& p, float scale,
             double alpha, int bins, std::int64_t b, std::int64_t h, std::int64_t t)
      : k_(k), v_(v), p_(p), scale_(scale), am1_(alpha - 1.0), r_(1.0 / (alpha - 1.0)), bins_(bins), b_(b),
        hk_(h / p.group_size()), rows_(detail::q_tile_rows(p, t)), R_(rows_.size()), w_(p.D) {
    detail::pack_rows(q, b, h, rows_, w_.q.data());
    row_end_.resize(static_cast<std::size_t>(R_));
    for (std::int64_t r = 0; r < R_; ++r) row_end_[static_cast<std::size_t>(r)] = detail::visible_key_end(p, rows_.begin + r);
    nblocks_ = detail::visible_blocks(p, rows_);
    words_ = ceil_div(p.Tk(), 32);
  }

  TileCounts run(float* out_rows /* [R x D] */, std::uint32_t* bits /* [words] */) {
    TileCounts counts;
    counts.visible = nblocks_;
    row_max();
    histogram_bounds();
    const std::vector<std::vector<std::pair<std::int64_t, double>>> candidates = collect_candidates();
    std::fill(bits, bits + words_, 0u);
    roots_.assign(static_cast<std::size_t>(R_), detail::EntmaxRoot{});
    std::vector<double> x;
    for (std::int64_t r = 0; r < R_; ++r) {
      const auto& cand = candidates[static_cast<std::size_t>(r)];
      if (cand.empty()) continue;  // the row sees no key, or holds a NaN or +inf score
      x.resize(cand.size());
      for (std::size_t i = 0; i < cand.size(); ++i) x[i] = cand[i].second;
      std::sort(x.begin(), x.end(), std::greater<double>());
      const detail::EntmaxRoot root =
          detail::solve_entmax_threshold(x.data(), nullptr, static_cast<std::int64_t>(x.size()), r_, am1_);
      roots_[static_cast<std::size_t>(r)] = root;
      for (const auto& [key, z] : cand)
        if (z >= root.anchor) {
          ++counts.support;
          const std::int64_t j = key / kBlockK;
          bits[j / 32] |= 1u << (j % 32);
        }
    }
    output(out_rows, bits, counts);
    for (std::int64_t r = 0; r < R_; ++r)
      if (poisoned_[static_cast<std::size_t>(r)])
        std::fill(out_rows + r * p_.D, out_rows + (r + 1) * p_.D, std::numeric_limits<float>::quiet_NaN());
    return counts;
  }

 private:
  // Scores of block j for every row; entries a row cannot see are left for the caller to skip.
  std::int64_t scores(std::int64_t j) {
    const detail::Span keys = detail::kv_block_keys(p_, j);
    detail::pack_keys_transposed(k_, b_, hk_, keys, w_.kt.data(), w_.row.data());
    detail::tile_scores(w_.q.data(), R_, w_.kt.data(), keys.size(), p_.D, scale_, w_.s.data());
    return keys.begin;
  }
  // Number of keys of the block starting at `key0` that row r sees.
  std::int64_t row_cols(std::int64_t r, std::int64_t key0) const {
    return std::clamp<std::int64_t>(row_end_[static_cast<std::size_t>(r)] - key0, 0,
                                    std::min<std::int64_t>(kBlockK, p_.Lk - key0));
  }
  double shifted(std::int64_t r, float z) const {
    return am1_ * (double(z) - double(zmax_[static_cast<std::size_t>(r)])) + 1.0;
  }

  // Also finds the rows holding a NaN or +inf score (their output is NaN, docs/design.md §2).
  void row_max() {
    zmax_.assign(static_cast<std::size_t>(R_), -std::numeric_limits<float>::infinity());
    poisoned_.assign(static_cast<std::size_t>(R_), 0);
    for (std::int64_t j = 0; j < nblocks_; ++j) {
      const std::int64_t key0 = scores(j);
      for (std::int64_t r = 0; r < R_; ++r) {
        const float* sr = w_.s.data() + r * kBlockK;
        float& m = zmax_[static_cast<std::size_t>(r)];
        char& bad = poisoned_[static_cast<std::size_t>(r)];
        for (std::int64_t c = 0, n = row_cols(r, key0); c < n; ++c) {
          m = std::max(m, sr[c]);
          bad |= !(sr[c] < std::numeric_limits<float>::infinity());
        }
      }
    }
  }
  // The row has a threshold to solve: it sees a key with a finite score and no NaN or +inf one.
  bool live(std::int64_t r) const {
    return !poisoned_[static_cast<std::size_t>(r)] && zmax_[static_cast<std::size_t>(r)] > -std::numeric_limits<float>::infinity();
  }

  void histogram_bounds() {
    std::vector<std::int64_t> hist(static_cast<std::size_t>(R_ * bins_), 0);
    for (std::int64_t j = 0; j < nblocks_; ++j) {
      const std::int64_t key0 = scores(j);
      for (std::int64_t r = 0; r < R_; ++r) {
        if (!live(r)) continue;
        const float* sr = w_.s.data() + r * kBlockK;
        std::int64_t* hr = hist.data() + r * bins_;
        for (std::int64_t c = 0, n = row_cols(r, key0); c < n; ++c) {
          const double u = shifted(r, sr[c]);
          if (u < 0.0) continue;  // cannot be active: tau* >= 0 in shifted units
          // The maximum (u = 1) falls in the last bin, rounded down by a full bin width.
          const auto bin = std::min<std::int64_t>(static_cast<std::int64_t>(u * bins_), bins_ - 1);
          ++hr[bin];
        }
      }
    }
    cut_.assign(static_cast<std::size_t>(R_), std::numeric_limits<double>::infinity());
    std::vector<double> edge, count;
    for (std::int64_t r = 0; r < R_; ++r) {
      if (!live(r)) continue;
      edge.clear();
      count.clear();
      const std::int64_t* hr = hist.data() + r * bins_;
      for (std::int64_t bin = bins_ - 1; bin >= 0; --bin)
        if (hr[bin] > 0) {
          edge.push_back(double(bin) / double(bins_));
          count.push_back(double(hr[bin]));
        }
      const detail::EntmaxRoot root =
          detail::solve_entmax_threshold(edge.data(), count.data(), static_cast<std::int64_t>(edge.size()), r_, 1.0);
      cut_[static_cast<std::size_t>(r)] = root.tau() - kCandidateSlack;
    }
  }

  std::vector<std::vector<std::pair<std::int64_t, double>>> collect_candidates() {
    std::vector<std::vector<std::pair<std::int64_t, double>>> cand(static_cast<std::size_t>(R_));
    for (std::int64_t j = 0; j < nblocks_; ++j) {
      const std::int64_t key0 = scores(j);
      for (std::int64_t r = 0; r < R_; ++r) {
        const float* sr = w_.s.data() + r * kBlockK;
        const double cut = cut_[static_cast<std::size_t>(r)];
        for (std::int64_t c = 0, n = row_cols(r, key0); c < n; ++c) {
          if (shifted(r, sr[c]) > cut) cand[static_cast<std::size_t>(r)].emplace_back(key0 + c, double(sr[c]));
        }
      }
    }
    return cand;
  }

  void output(float* out_rows, const std::uint32_t* bits, TileCounts& counts) {
    const std::int64_t D = p_.D;
    std::fill(out_rows, out_rows + R_ * D, 0.0f);
    for (std::int64_t wi = 0; wi < words_; ++wi) {
      const std::uint32_t word = bits[wi];
      const int n = std::popcount(word);
      counts.active += n;
      for (int rank = 0; rank < n; ++rank) {
        const std::int64_t j = 32 * wi + nth_set_bit(word, rank);
        const std::int64_t key0 = scores(j);
        const std::int64_t C = detail::kv_block_keys(p_, j).size();
        for (std::int64_t c = 0; c < C; ++c) detail::load_bhld(v_, b_, key0 + c, hk_, w_.v.data() + c * D);
        for (std::int64_t r = 0; r < R_; ++r) {
          const detail::EntmaxRoot& root = roots_[static_cast<std::size_t>(r)];
          if (root.support == 0) continue;
          const float* sr = w_.s.data() + r * kBlockK;
          float* orow = out_rows + r * D;
          for (std::int64_t c = 0, nc = row_cols(r, key0); c < nc; ++c) {
            if (!(double(sr[c]) >= root.anchor)) continue;
            const float pw = static_cast<float>(root.weight(sr[c]));
            const float* vc = w_.v.data() + c * D;
            for (std::int64_t d = 0; d < D; ++d) orow[d] += pw * vc[d];
          }
        }
      }
    }
  }

  const TensorView& k_;
  const TensorView& v_;
  const ProblemShape& p_;
  float scale_;
  double am1_, r_;
  std::int64_t bins_, b_, hk_;
  detail::Span rows_;
  std::int64_t R_;
  detail::TileScratch w_;
  std::vector<std::int64_t> row_end_;
  std::int64_t nblocks_ = 0, words_ = 0;
  std::vector<float> zmax_;
  std::vector<char> poisoned_;  // per row: a visible score is NaN or +inf
  std::vector<double> cut_;
  std::vector<detail::EntmaxRoot> roots_;
};

EntmaxStats entmax_cpu(const detail::AttentionCall& a, const EntmaxOptions& options) {
  const ProblemShape& p = a.p;
  const std::int64_t Tq = p.Tq(), words = ceil_div(p.Tk(), 32);
  std::vector<TileCounts> counts(static_cast<std::size_t>(p.B * p.Hq * Tq));
  detail::parallel_for(p.B * p.Hq * Tq, [&](std::int64_t item) {
    const std::int64_t t = item % Tq, h = (item / Tq) % p.Hq, b = item / (Tq * p.Hq);
    EntmaxTile tile(a.q, a.k, a.v, p, a.scale, options.alpha, options.histogram_bins, b, h, t);
    const detail::Span rows = detail::q_tile_rows(p, t);
    std::vector<float> out_rows(static_cast<std::size_t>(rows.size() * p.D));
    std::vector<std::uint32_t> bits(static_cast<std::size_t>(words));
    counts[static_cast<std::size_t>(item)] = tile.run(out_rows.data(), bits.data());
    for (std::int64_t r = 0; r < rows.size(); ++r)
      detail::store_row(a.out, detail::addr4(a.out, b, rows.begin + r, h, 0), p.D, out_rows.data() + r * p.D);
    if (options.block_bits) {
      const TensorView& bb = *options.block_bits;
      for (std::int64_t w = 0; w < words; ++w)
        *reinterpret_cast<std::uint32_t*>(detail::addr4(bb, b, h, t, w)) = bits[static_cast<std::size_t>(w)];
    }
  });
  EntmaxStats stats;
  for (const TileCounts& c : counts) {
    stats.active_tiles += c.active;
    stats.visible_tiles += c.visible;
    stats.support += c.support;
  }
  return stats;
}

}  // namespace

EntmaxStats entmax(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                   const EntmaxOptions& options) {
  AttentionOptions attention;
  attention.softmax_scale = options.softmax_scale;
  attention.causal = options.causal;
  attention.stream = options.stream;
  const detail::AttentionCall a = detail::resolve_call(kOp, q, k, v, out, std::nullopt, attention);
  const ProblemShape& p = a.p;
  detail::require(std::isfinite(options.alpha) && options.alpha > 1.0f, kOp, "options.alpha",
                  [&] { return "must be finite and > 1, got " + std::to_string(options.alpha); });
  detail::require(options.histogram_bins >= 2 && options.histogram_bins <= kMaxHistogramBins, kOp,
                  "options.histogram_bins",
                  [&] { return
                      "must be in [2, " + std::to_string(kMaxHistogramBins) + "], got " +
                      std::to_string(options.histogram_bins); });
  if (options.block_bits) {
    const TensorView& bb = *options.block_bits;
    detail::check_tensor(kOp, "options.block_bits", bb, 4, {DType::u32});
    detail::check_same_device(kOp, "options.block_bits", bb, "q", q);
    detail::check_shape(kOp, "options.block_bits", bb, {p.B, p.Hq, p.Tq(), ceil_div(p.Tk(), 32)});
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}})
      detail::check_no_overlap(kOp, "options.block_bits", bb, name, *t);
  }

  switch (q.device) {
    case Device::cpu: return entmax_cpu(a, options);
    case Device::cuda:
#if defined(SPARSE_ATTN_WITH_CUDA)
      // The GPU holds the threshold in float32 score units; above kMaxCudaEntmaxAlpha that resolution
      // leaves the weights near the threshold wrong by more than bf16 rounding (measured: 5-10 %
      // relative error at alpha 16), so such calls are refused rather than answered approximately.
      detail::require(options.alpha <= kMaxCudaEntmaxAlpha, kOp, "options.alpha", [&] {
        return "the CUDA executor takes alpha in (1, " + std::to_string(kMaxCudaEntmaxAlpha).substr(0, 3) +
               "], got " + std::to_string(options.alpha) + " (the CPU executor takes any alpha > 1)";
      });
      cuda_backend::raise_pending_fault(q.device_index, options.stream, kOp);
      return cuda_backend::entmax(a, options);
#else
      break;
#endif
  }
  detail::unsupported_device(kOp, "q", q);
}

}  // namespace sparse_attn
