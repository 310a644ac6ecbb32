// gated (BSFA, docs/design.md §5.5): causal attention that scores every visible block exactly and runs the
// value side only for blocks whose scaled block maximum over a gate tile (kGateRows queries) reaches
// the calibrated threshold. The CPU reference; the CUDA backend runs the gate policy of the Q-centric
// kernel (cuda/attention/gate_policy.cuh) with the same definition.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "core/call.hpp"
#include "core/check.hpp"
#include "core/cpu.hpp"
#include "gated/tile_kernels.hpp"
#include "sparse_attn/ops.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/backend.hpp"
#endif

namespace sparse_attn {
namespace {

constexpr const char* kOp = "gated";
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float threshold_at(const TensorView& t, std::int64_t h, std::int64_t col) {
  return *(t.ptr<const float>() + h * t.stride[0] + col * t.stride[1]);
}

// Counters of one (b, h, gate tile) work item; summed after the parallel loop so the totals are exact
// and independent of scheduling.
struct TileCounts {
  std::int64_t kept = 0, visible = 0, candidates = 0, gated_kept = 0;
};

TileCounts gated_tile_cpu(const TensorView& q, const TensorView& k, const TensorView& v,
                          const TensorView& thresholds, const TensorView& out, const std::optional<TensorView>& lse,
                          const ProblemShape& p, float scale, std::int64_t sink_blocks, std::int64_t b,
                          std::int64_t h, std::int64_t g, detail::TileScratch& w) {
  const std::int64_t D = p.D, hk = h / p.group_size();
  const detail::Span rows = detail::gate_tile_rows(p, g);
  const std::int64_t R = rows.size();
  const float threshold = threshold_at(thresholds, h, std::min(g, thresholds.shape[1] - 1));

  detail::pack_rows(q, b, h, rows, w.q.data());
  std::vector<float> m(static_cast<std::size_t>(R), kNegInf), l(static_cast<std::size_t>(R), 0.0f);
  std::vector<float> acc(static_cast<std::size_t>(R * D), 0.0f);
  std::vector<std::int64_t> row_end(static_cast<std::size_t>(R));
  for (std::int64_t r = 0; r < R; ++r) row_end[static_cast<std::size_t>(r)] = detail::visible_key_end(p, rows.begin + r);

  TileCounts counts;
  const std::int64_t nblocks = detail::visible_blocks(p, rows);
  for (std::int64_t j = 0; j < nblocks; ++j) {
    const detail::Span keys = detail::kv_block_keys(p, j);
    const std::int64_t C = keys.size();
    const bool diagonal = detail::straddles_diagonal(p, rows, keys);
    const bool candidate = detail::gate_candidate(p, rows, keys, j, sink_blocks);
    detail::pack_keys_transposed(k, b, hk, keys, w.kt.data(), w.row.data());
    detail::tile_scores(w.q.data(), R, w.kt.data(), C, D, scale, w.s.data());
    ++counts.visible;

    if (diagonal) {
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t visible = std::clamp<std::int64_t>(row_end[static_cast<std::size_t>(r)] - keys.begin, 0, C);
        for (std::int64_t c = visible; c < C; ++c) w.s[static_cast<std::size_t>(r * kBlockK + c)] = kNegInf;
      }
    } else if (candidate) {
      // Every pair of an off-diagonal block is visible, so its maximum is over the whole gate tile.
      float block_max = kNegInf;
      bool nan = false;
      for (std::int64_t r = 0; r < R; ++r)
        for (std::int64_t c = 0; c < C; ++c) {
          const float x = w.s[static_cast<std::size_t>(r * kBlockK + c)];
          block_max = std::max(block_max, x);
          nan = nan || std::isnan(x);
        }
      ++counts.candidates;
      // ">=" as in the BSFA paper's main text: a block whose maximum equals the threshold is kept,
      // so a threshold of -inf keeps every block. A NaN score cannot be ranked: its block is kept, so
      // the NaN reaches the rows (docs/design.md §2).
      if (!(nan || block_max >= threshold)) continue;
      ++counts.gated_kept;
    }
    ++counts.kept;

    for (std::int64_t c = 0; c < C; ++c) detail::load_bhld(v, b, keys.begin + c, hk, w.v.data() + c * D);
    for (std::int64_t r = 0; r < R; ++r) {
      float* sr = w.s.data() + r * kBlockK;
      const std::int64_t visible =
          diagonal ? std::clamp<std::int64_t>(row_end[static_cast<std::size_t>(r)] - keys.begin, 0, C) : C;
      if (visible == 0) continue;  // this row sees no key of the block
      float block_row_max = kNegInf;
      for (std::int64_t c = 0; c < C; ++c) block_row_max = std::max(block_row_max, sr[c]);
      float& mr = m[static_cast<std::size_t>(r)];
      // std::max passes over NaN, so m is never NaN; while it is -inf (every score seen so far -inf),
      // subtracting 0 keeps exp(-inf - -inf) from being NaN. NaN and +inf scores make sum NaN.
      const float m_new = std::max(mr, block_row_max);
      const float base = m_new == kNegInf ? 0.0f : m_new;
      const float rescale = std::exp(mr - base);  // exp(-inf) = 0 for the first block of the row
      float sum = 0.0f;
      for (std::int64_t c = 0; c < C; ++c) {
        sr[c] = std::exp(sr[c] - base);
        sum += sr[c];
      }
      float* ar = acc.data() + r * D;
      if (rescale != 1.0f)
        for (std::int64_t d = 0; d < D; ++d) ar[d] *= rescale;
      for (std::int64_t c = 0; c < C; ++c) {
        const float pc = sr[c];
        if (pc == 0.0f) continue;
        const float* vc = w.v.data() + c * D;
        for (std::int64_t d = 0; d < D; ++d) ar[d] += pc * vc[d];
      }
      l[static_cast<std::size_t>(r)] = l[static_cast<std::size_t>(r)] * rescale + sum;
      mr = m_new;
    }
  }

  for (std::int64_t r = 0; r < R; ++r) {
    float* ar = acc.data() + r * D;
    const float lr = l[static_cast<std::size_t>(r)], mr = m[static_cast<std::size_t>(r)];
    // A row whose kept blocks hold none of its visible keys sees no key: out = 0, lse = -inf. Any
    // other state divides by l: NaN (a NaN or +inf score) gives NaN out and lse.
    const bool no_key = lr == 0.0f && mr == kNegInf;
    const float inv = no_key ? 0.0f : 1.0f / lr;
    for (std::int64_t d = 0; d < D; ++d) ar[d] *= inv;
    detail::store_row(out, detail::addr4(out, b, rows.begin + r, h, 0), D, ar);
    if (lse) {
      const float value = no_key ? kNegInf : mr + std::log(lr);
      *(lse->ptr<float>() + b * lse->stride[0] + h * lse->stride[1] + (rows.begin + r) * lse->stride[2]) = value;
    }
  }
  return counts;
}

GatedStats gated_cpu(const detail::AttentionCall& a, const TensorView& thresholds, const GatedOptions& options) {
  const ProblemShape& p = a.p;

  const std::int64_t Tg = detail::gate_tiles(p);
  std::vector<TileCounts> counts(static_cast<std::size_t>(p.B * p.Hq * Tg));
  detail::parallel_for(p.B * p.Hq * Tg, [&](std::int64_t item) {
    const std::int64_t t = item % Tg, h = (item / Tg) % p.Hq, b = item / (Tg * p.Hq);
    detail::TileScratch scratch(p.D);
    const TileCounts c =
        gated_tile_cpu(a.q, a.k, a.v, thresholds, a.out, a.lse, p, a.scale, options.sink_blocks, b, h, t, scratch);
    counts[static_cast<std::size_t>(item)] = c;
    if (options.kept_per_tile) {
      const TensorView& kp = *options.kept_per_tile;
      *(kp.ptr<std::int32_t>() + b * kp.stride[0] + h * kp.stride[1] + t * kp.stride[2]) =
          static_cast<std::int32_t>(c.kept);
    }
  });

  GatedStats stats;
  for (const TileCounts& c : counts) {
    stats.kept_blocks += c.kept;
    stats.visible_blocks += c.visible;
    stats.gated_candidates += c.candidates;
    stats.gated_kept += c.gated_kept;
  }
  if (options.counts) {
    std::int32_t* out = options.counts->ptr<std::int32_t>();
    const std::int64_t values[4] = {stats.kept_blocks, stats.visible_blocks, stats.gated_candidates, stats.gated_kept};
    for (int i = 0; i < 4; ++i) out[i * options.counts->stride[0]] = static_cast<std::int32_t>(values[i]);
  }
  return stats;
}

}  // namespace

GatedStats gated(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& thresholds,
                 const TensorView& out, const std::optional<TensorView>& lse, const GatedOptions& options) {
  AttentionOptions attention;
  attention.softmax_scale = options.softmax_scale;
  attention.causal = true;  // BSFA is a causal prefill operator
  attention.stream = options.stream;
  const detail::AttentionCall a = detail::resolve_call(kOp, q, k, v, out, lse, attention);
  const ProblemShape& p = a.p;

  detail::check_tensor(kOp, "thresholds", thresholds, 2, {DType::f32});
  detail::check_same_device(kOp, "thresholds", thresholds, "q", q);
  detail::check_shape(kOp, "thresholds", thresholds, {p.Hq, -1});
  detail::require(thresholds.shape[1] >= 1, kOp, "thresholds",
                  [&] { return "needs at least one Q tile column, got shape " + detail::shape_string(thresholds); });
  detail::check_outputs_apart(kOp, out, lse, "thresholds", thresholds);
  detail::require(options.sink_blocks >= 0, kOp, "options.sink_blocks",
                  [&] { return "must be >= 0, got " + std::to_string(options.sink_blocks); });
  const std::int64_t Tg = detail::gate_tiles(p);
  // Every other argument an optional output must not overlap.
  std::vector<std::pair<const char*, const TensorView*>> others = {
      {"q", &q}, {"k", &k}, {"v", &v}, {"thresholds", &thresholds}, {"out", &out}};
  if (lse) others.emplace_back("lse", &*lse);
  if (options.kept_per_tile) {
    const TensorView& kp = *options.kept_per_tile;
    detail::check_tensor(kOp, "options.kept_per_tile", kp, 3, {DType::i32});
    detail::check_same_device(kOp, "options.kept_per_tile", kp, "q", q);
    detail::check_shape(kOp, "options.kept_per_tile", kp, {p.B, p.Hq, Tg});
    for (const auto& [name, t] : others) detail::check_no_overlap(kOp, "options.kept_per_tile", kp, name, *t);
  }
  if (options.counts) {
    const TensorView& c = *options.counts;
    detail::check_tensor(kOp, "options.counts", c, 1, {DType::i32});
    detail::check_same_device(kOp, "options.counts", c, "q", q);
    detail::check_shape(kOp, "options.counts", c, {4});
    // Every counter is at most the (b, h, gate tile, kv block) count, which must fit in int32.
    const double visits = double(p.B) * double(p.Hq) * double(Tg) * double(p.Tk());
    detail::require(visits <= double(std::numeric_limits<std::int32_t>::max()), kOp, "options.counts", [&] {
      return "int32 counters cannot hold the " + std::to_string(static_cast<long long>(visits)) +
             " (batch, head, gate tile, kv block) visits of " + p.describe() + "; ask for the returned GatedStats";
    });
    for (const auto& [name, t] : others) detail::check_no_overlap(kOp, "options.counts", c, name, *t);
    if (options.kept_per_tile) detail::check_no_overlap(kOp, "options.counts", c, "options.kept_per_tile", *options.kept_per_tile);
  }
  if (q.device == Device::cpu) {
    for (std::int64_t h = 0; h < thresholds.shape[0]; ++h)
      for (std::int64_t c = 0; c < thresholds.shape[1]; ++c)
        detail::require(!std::isnan(threshold_at(thresholds, h, c)), kOp, "thresholds",
                        [&] { return "NaN at " + detail::coord_string({h, c}); });
    return gated_cpu(a, thresholds, options);
  }
#if defined(SPARSE_ATTN_WITH_CUDA)
  return cuda_backend::gated(a, thresholds, options);
#else
  detail::unsupported_device(kOp, "q", q);
#endif
}

}  // namespace sparse_attn
