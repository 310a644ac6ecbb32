// R1 / R4 pooled selector on the CPU (docs/design.md §5.7, seed chapter 4).
//
// Representatives are computed once per (batch, head, tile or block, group) and then every
// (batch, group, Q tile) ranks its candidate blocks independently.
#include <limits>
#include <vector>

#include "selectors/select_common.hpp"
#if defined(SPARSE_ATTN_WITH_CUDA)
#include "cuda/selectors/backend.hpp"
#endif
#include "sparse_attn/selectors.hpp"

namespace sparse_attn {

namespace {

using detail::require;
using detail::Scored;

constexpr double kForced = std::numeric_limits<double>::infinity();

struct PooledShape {
  std::int64_t B, Lq, Lk, Hq, Hkv, D, Tq, Tk, r, span;  // span = tokens per representative
};

// Means of `span` consecutive rows of a [B, L, H, D] tensor, r per tile of `tile` rows:
// mean[((b * H + h) * T + t) * r + a] holds D floats, and count[...] the number of tokens averaged
// (0: the representative is absent).
struct Representatives {
  std::vector<float> mean;
  std::vector<std::int32_t> count;
};

Representatives build_representatives(const TensorView& x, std::int64_t B, std::int64_t L, std::int64_t H,
                                      std::int64_t D, std::int64_t tile, std::int64_t r) {
  const std::int64_t T = ceil_div(L, tile), span = tile / r;
  Representatives reps;
  reps.mean.assign(static_cast<std::size_t>(B * H * T * r * D), 0.0f);
  reps.count.assign(static_cast<std::size_t>(B * H * T * r), 0);
  detail::parallel_for(B * T, [&](std::int64_t bt) {
    const std::int64_t b = bt / T, t = bt % T;
    std::vector<float> row(static_cast<std::size_t>(D));
    std::vector<double> acc(static_cast<std::size_t>(D));
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t a = 0; a < r; ++a) {
        const std::int64_t l0 = t * tile + a * span;
        const std::int64_t l1 = std::min(L, l0 + span);
        const std::int64_t slot = ((b * H + h) * T + t) * r + a;
        if (l1 <= l0) continue;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (std::int64_t l = l0; l < l1; ++l) {
          detail::load_bhld(x, b, l, h, row.data());
          for (std::int64_t d = 0; d < D; ++d) acc[static_cast<std::size_t>(d)] += row[static_cast<std::size_t>(d)];
        }
        float* dst = reps.mean.data() + slot * D;
        const double n = static_cast<double>(l1 - l0);
        for (std::int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(acc[static_cast<std::size_t>(d)] / n);
        reps.count[static_cast<std::size_t>(slot)] = static_cast<std::int32_t>(l1 - l0);
      }
    }
  });
  return reps;
}

void check_pooled_args(const std::string& op, const TensorView& q, const TensorView& k, const TileLists& out,
                       const PooledOptions& o, PooledShape& s) {
  require(o.top_k >= 1, op, "options.top_k", [&] { return "must be >= 1, got " + std::to_string(o.top_k); });
  require(o.representatives == 1 || o.representatives == 4, op, "options.representatives",
          [&] { return "must be 1 or 4, got " + std::to_string(o.representatives); });
  detail::check_tensor(op, "q", q, 4, {DType::bf16, DType::f16, DType::f32});
  detail::check_tensor(op, "k", k, 4, {DType::bf16, DType::f16, DType::f32});
  require(k.dtype == q.dtype, op, "k",
          [&] { return std::string("dtype ") + dtype_name(k.dtype) + " differs from q's " + dtype_name(q.dtype); });
  detail::check_same_device(op, "k", k, "q", q);
  s.B = q.shape[0];
  s.Lq = q.shape[1];
  s.Hq = q.shape[2];
  s.D = q.shape[3];
  s.Lk = k.shape[1];
  s.Hkv = k.shape[2];
  require(s.B > 0 && s.Lq > 0 && s.Hq > 0 && s.D > 0, op, "q",
          [&] { return "every extent must be > 0, got " + detail::shape_string(q); });
  require(s.Lk > 0 && s.Hkv > 0, op, "k", [&] { return "every extent must be > 0, got " + detail::shape_string(k); });
  detail::check_shape(op, "k", k, {s.B, -1, -1, s.D});
  detail::check_head_ratio(op, "k", s.Hq, s.Hkv);
  detail::check_last_contiguous(op, "q", q);
  detail::check_last_contiguous(op, "k", k);
  s.Tq = ceil_div(s.Lq, kTileQ);
  s.Tk = ceil_div(s.Lk, kBlockK);
  s.r = o.representatives;
  s.span = kTileQ / s.r;
  detail::check_tensor(op, "out.idx", out.idx, 4, {DType::i32});
  detail::check_shape(op, "out.idx", out.idx, {s.B, s.Hkv, s.Tq, -1});
  require(out.idx.shape[3] >= o.top_k, op, "out.idx",
          [&] { return
              "capacity Kmax = " + std::to_string(out.idx.shape[3]) + " is smaller than options.top_k = " +
              std::to_string(o.top_k); });
  detail::check_tensor(op, "out.cnt", out.cnt, 3, {DType::i32});
  detail::check_shape(op, "out.cnt", out.cnt, {s.B, s.Hkv, s.Tq});
  detail::check_same_device(op, "out.idx", out.idx, "q", q);
  detail::check_same_device(op, "out.cnt", out.cnt, "q", q);
}

void pooled_select_cpu(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& o,
                       const PooledShape& s) {
  // The representative span is the same for queries and keys because kTileQ == kBlockK.
  static_assert(kTileQ == kBlockK);
  const Representatives qr = build_representatives(q, s.B, s.Lq, s.Hq, s.D, kTileQ, s.r);
  const Representatives kr = build_representatives(k, s.B, s.Lk, s.Hkv, s.D, kBlockK, s.r);
  const std::int64_t group = s.Hq / s.Hkv;
  const std::int64_t offset = s.Lk - s.Lq;

  detail::parallel_for(s.B * s.Hkv * s.Tq, [&](std::int64_t job) {
    const std::int64_t t = job % s.Tq;
    const std::int64_t g = (job / s.Tq) % s.Hkv;
    const std::int64_t b = job / (s.Tq * s.Hkv);
    const std::int64_t i_first = t * kTileQ;
    const std::int64_t i_last = std::min(s.Lq, i_first + kTileQ) - 1;

    // Causal: block j is a candidate iff the tile's last query sees the block's first key.
    const std::int64_t n_cand = o.causal ? std::clamp<std::int64_t>(ceil_div(i_last + offset + 1, kBlockK), 0, s.Tk) : s.Tk;
    std::vector<Scored> cand;
    cand.reserve(static_cast<std::size_t>(n_cand));
    std::vector<std::uint8_t> forced(static_cast<std::size_t>(s.Tk), 0);
    if (n_cand > 0) {
      if (o.force_block0) forced[0] = 1;
      if (o.force_local) {
        if (o.causal) {
          const std::int64_t lo = std::max<std::int64_t>(i_first + offset, 0) / kBlockK;
          const std::int64_t hi = (i_last + offset) / kBlockK;
          for (std::int64_t j = lo; j <= hi; ++j) forced[static_cast<std::size_t>(j)] = 1;
        } else {
          forced[static_cast<std::size_t>(std::min(i_first * s.Lk / s.Lq / kBlockK, s.Tk - 1))] = 1;
        }
      }
    }

    for (std::int64_t j = 0; j < n_cand; ++j) {
      if (forced[static_cast<std::size_t>(j)]) {
        cand.push_back({kForced, static_cast<std::int32_t>(j)});
        continue;
      }
      double best = -std::numeric_limits<double>::infinity();
      for (std::int64_t a = 0; a < s.r; ++a) {
        const std::size_t qa0 = static_cast<std::size_t>(((b * s.Hq + g * group) * s.Tq + t) * s.r + a);
        const std::int32_t qn = qr.count[qa0];
        if (qn == 0) continue;
        const std::int64_t q_last = i_first + a * s.span + qn - 1;
        for (std::int64_t c = 0; c < s.r; ++c) {
          const std::size_t kc = static_cast<std::size_t>(((b * s.Hkv + g) * s.Tk + j) * s.r + c);
          if (kr.count[kc] == 0) continue;
          // A representative pair counts iff the query group's last query sees the key group's first key.
          if (o.causal && j * kBlockK + c * s.span > q_last + offset) continue;
          const float* kp = kr.mean.data() + static_cast<std::int64_t>(kc) * s.D;
          for (std::int64_t h = 0; h < group; ++h) {
            const std::int64_t qa = ((b * s.Hq + g * group + h) * s.Tq + t) * s.r + a;
            best = std::max(best, detail::sanitize(detail::dot_f64(qr.mean.data() + qa * s.D, kp, s.D)));
          }
        }
      }
      cand.push_back({best, static_cast<std::int32_t>(j)});
    }

    std::vector<std::int32_t> ids;
    const std::int64_t cnt = detail::top_k_ascending(cand, o.top_k, ids);
    detail::write_padded(detail::idx_ptr4(out.idx, b, g, t, 0), out.idx.stride[3], out.idx.shape[3], ids);
    *reinterpret_cast<std::int32_t*>(static_cast<char*>(out.cnt.data) +
                                     (b * out.cnt.stride[0] + g * out.cnt.stride[1] + t * out.cnt.stride[2]) * 4) =
        static_cast<std::int32_t>(cnt);
  });
}

}  // namespace

void pooled_select(const TensorView& q, const TensorView& k, const TileLists& out, const PooledOptions& options) {
  const std::string op = "pooled_select";
  PooledShape s{};
  check_pooled_args(op, q, k, out, options, s);
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) return cuda_backend::pooled_select(q, k, out, options);
#endif
  if (q.device != Device::cpu) detail::unsupported_device(op, "q", q);
  pooled_select_cpu(q, k, out, options, s);
}

std::size_t pooled_workspace_bytes(const TensorView& q, const TensorView& k, const PooledOptions& options) {
  const std::string op = "pooled_workspace_bytes";
  detail::require(q.ndim == 4, op, "q", [&] { return "expected [B, Lq, Hq, D], got " + q.describe(); });
  detail::require(k.ndim == 4, op, "k", [&] { return "expected [B, Lk, Hkv, D], got " + k.describe(); });
#if defined(SPARSE_ATTN_WITH_CUDA)
  if (q.device == Device::cuda) {
    const ProblemShape s{q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], options.causal};
    return cuda_backend::pooled_scratch_bytes(s, options);
  }
#else
  (void)options;
#endif
  return 0;
}

}  // namespace sparse_attn
